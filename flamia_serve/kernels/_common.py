"""``@triton.jit`` helpers shared by kernels: the bit-level rules of ``numerics.formats``.

Each helper repeats its ``numerics`` twin operation for operation so results match bit
for bit (tests compare them).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import types
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain

from flamia_serve.numerics import operands
from flamia_serve.numerics.formats import NVFP4_ERROR_BITS as _NVFP4_ERROR_BITS
from flamia_serve.numerics.formats import NVFP4_ERROR_CAP as _NVFP4_ERROR_CAP
from flamia_serve.numerics.scales import V_ZERO_EXPONENT as _V_ZERO_EXPONENT


def _jit_int_rule(fn: types.FunctionType) -> triton.JITFunction:
    """``triton.jit`` of a plain-int rule written for torch and Triton alike (``numerics``
    stays free of Triton; the JIT wants ``tl`` among the function's globals)."""
    return triton.jit(types.FunctionType(fn.__code__, {"tl": tl, "__name__": fn.__module__}))


#: ``operands.v_t_key`` inside kernels: the token stored at a column of the column layout
v_t_key = _jit_int_rule(operands.v_t_key)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of ints on the host (``triton.cdiv`` is a constexpr function: its
    wrapper costs ~2 µs of host time a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (1 for n <= 1), on the host (``triton.next_power_of_2``
    is a constexpr function, ~2 µs a call)."""
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs host time on
    every call otherwise)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def cute_dsl_available(device: torch.device) -> bool:
    """The CuTe DSL serving decodes run here: an sm_90 GPU with ``nvidia-cutlass-dsl``
    installed (vLLM installs it; so does the ``cute`` extra)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return importlib.util.find_spec("cutlass") is not None


@functools.cache
def cute_available(device: torch.device) -> bool:
    """The CuTe DSL training kernels run here: :func:`cute_dsl_available` and
    ``flash-attn-4`` (their pipelines and MMA helpers) installed: the ``cute`` extra."""
    return cute_dsl_available(device) and importlib.util.find_spec("flash_attn") is not None


class TritonLaunch:
    """A Triton kernel launched past ``JITFunction.run``'s per-call binding (its Python
    costs ~20-30 µs of host time a launch).

    ``launch(grid, *args, **kwargs)`` takes what ``kernel[grid](*args, **kwargs)`` takes.
    A launch whose arguments specialise like an earlier one's (the same non-tensor values
    and options; tensors of the same dtypes, devices and 16-byte alignment: what Triton
    specialises pointers on) calls that launch's ``CompiledKernel`` directly, tensors passed
    as their addresses (the launcher then skips its per-pointer ``data_ptr`` call and
    pointer query); any other goes through the ``JITFunction`` (which compiles or finds the
    kernel, and checks the pointers) and is remembered (up to ``MAX_SPECIALISATIONS``, then
    the memory starts over). Under the CPU interpreter every launch goes through the
    ``JITFunction``. Returns the runner that launched (:func:`compiled_runner`, which takes
    :func:`launch_values`), None when the launch went through the ``JITFunction`` without
    one (interpreter, unhashable arguments, parameters left to their defaults).
    """

    MAX_SPECIALISATIONS = 256

    def __init__(self, kernel: triton.JITFunction) -> None:
        self.kernel = kernel
        self._params = frozenset(kernel.arg_names)
        self._runners: dict[tuple, Callable] = {}

    def __call__(self, grid: tuple[int, ...], *args: object, **kwargs: object) -> Callable | None:
        grid = (*grid, 1, 1)[:3]  # what a CompiledKernel's runner indexes
        values = launch_values(self.kernel, args, kwargs)
        if values is None:  # a parameter left to its default: no fast path
            self.kernel[grid](*args, **kwargs)
            return None
        key = [grid]
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                values[i] = address = v.data_ptr()
                key.append((v.dtype, v.get_device(), address % 16 == 0))
            else:
                key.append(v)
        key += [(k, v) for k, v in kwargs.items() if k not in self._params]  # options
        try:
            runner = self._runners.get(tuple(key))
        except TypeError:  # an unhashable argument: no fast path
            self.kernel[grid](*args, **kwargs)
            return None
        if runner is not None:
            runner(*values)
            return runner
        compiled = self.kernel[grid](*args, **kwargs)
        if not isinstance(compiled, CompiledKernel):
            return None
        if len(self._runners) >= self.MAX_SPECIALISATIONS:
            self._runners.clear()
        runner = self._runners[tuple(key)] = compiled_runner(compiled, grid)
        return runner


def _current_raw_stream() -> int:
    """The current CUDA stream of the current device, as Triton's launcher takes it."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def compiled_runner(compiled: CompiledKernel, grid: tuple[int, int, int]) -> Callable:
    """``compiled[grid]`` (its runner: ``runner(*launch_values)``, tensors or addresses)
    without that runner's per-launch Python while no launch hook is set: it asks Triton's
    driver proxy for the device and stream and builds the hooks' launch metadata at every
    launch (several µs of host time on the GPU hosts); this one hands the launcher the current
    stream and no hooks. With a hook set (profilers such as Proton add them) every launch
    goes through Triton's runner, so the hooks see it."""
    standard = compiled[grid]  # loads the kernel (CompiledKernel._init_handles)
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    hooks = knobs.runtime
    g0, g1, g2 = grid

    def runner(*values: object) -> None:
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        unhooked = type(enter) is HookChain and type(leave) is HookChain
        if unhooked and not (enter.calls or leave.calls):
            run(g0, g1, g2, _current_raw_stream(), function, metadata, None, None, None, *values)
        else:
            standard(*values)

    return runner


def launch_values(
    kernel: triton.JITFunction, args: Sequence[object], kwargs: dict[str, object]
) -> list[object] | None:
    """Every parameter's value of ``kernel[grid](*args, **kwargs)`` in the kernel's order
    (what a ``CompiledKernel``'s runner takes, tensors as they are), None when a parameter
    is left to its default."""
    try:
        return [*args, *(kwargs[n] for n in kernel.arg_names[len(args) :])]
    except KeyError:
        return None


def bind_slots(
    args: Sequence[object], slots: dict[str, torch.Tensor | None]
) -> tuple[list[object], list[tuple[int, str]], bool]:
    """``(template, positions, reusable)`` of a call's positional ``args`` whose ``slots``
    (name -> the tensor this call passes; None: no such tensor) change from call to call:
    ``template`` is ``args`` with None at the slots' positions (it keeps no slot tensor
    alive), ``positions`` the ``(position, name)`` pairs, found by identity. ``reusable`` is
    False when one tensor fills two slots (a later call whose tensors differ could then not
    be told apart)."""
    names = {id(t): name for name, t in slots.items() if t is not None}
    reusable = len(names) == sum(t is not None for t in slots.values())
    template, positions = list(args), []
    for pos, arg in enumerate(args):
        name = names.get(id(arg))
        if name is not None:
            positions.append((pos, name))
            template[pos] = None
    return template, positions, reusable


class _Slots:
    """Arguments of a call, some of them (``slots``: name -> tensor) to be replaced at later
    calls once :meth:`keep` has bound them (until then the call runs with the tensors it
    was made with, unless given others)."""

    def __init__(self, args: Sequence[object], slots: dict[str, torch.Tensor | None]) -> None:
        self.args: Sequence[object] = args
        self.slots: dict[str, torch.Tensor | None] | None = slots
        self.positions: list[tuple[int, str]] = []
        self.reusable = False  # set by keep()

    def keep(self) -> bool:
        """Bind the slots (:func:`bind_slots`; the slots' tensors are no longer held):
        whether later calls with other tensors can run it."""
        if self.slots is None:
            return self.reusable
        self.args, self.positions, self.reusable = bind_slots(self.args, self.slots)
        self.slots = None
        return self.reusable

    def filled(self, tensors: dict[str, torch.Tensor | None]) -> Sequence[object]:
        """The arguments with ``tensors`` in the slots."""
        slots = self.slots
        if slots is not None:  # not kept: made for one call, usually with these tensors
            for name, t in slots.items():
                if t is not None and tensors.get(name) is not t:
                    break
            else:
                return self.args
            self.keep()
        args = list(self.args)
        for pos, name in self.positions:
            args[pos] = tensors[name]
        return args


class BoundCall(_Slots):
    """``fn(*args)`` for calls that differ only in the tensors of ``slots``: ``bound(
    **tensors)`` calls it with each slot's tensor in place (the CuTe kernels' TVM-FFI
    calls); :meth:`keep` before keeping it for later calls.

    ``fixed`` (e.g. ``tvm_ffi.from_dlpack``): applied once, when :meth:`keep` binds the
    slots, to every tensor argument outside them, so later calls pass those converted
    (TVM-FFI converts a torch tensor at every call otherwise). TVM-FFI takes the call's
    stream from its torch tensors: calls must pass at least one slot's tensor."""

    def __init__(
        self,
        fn: Callable,
        args: Sequence[object],
        slots: dict[str, torch.Tensor | None],
        fixed: Callable[[torch.Tensor], object] | None = None,
    ) -> None:
        super().__init__(args, slots)
        self.fn, self.fixed = fn, fixed

    def keep(self) -> bool:
        reusable = super().keep()
        if reusable and self.fixed is not None and self.positions:
            convert, self.fixed = self.fixed, None
            self.args = [convert(a) if isinstance(a, torch.Tensor) else a for a in self.args]
        return reusable

    def __call__(self, **tensors: torch.Tensor | None) -> None:
        self.fn(*self.filled(tensors))


class BoundLaunch(_Slots):
    """A Triton launch ``launch(grid, *args, **kwargs)`` for calls that differ only in the
    tensors of ``slots`` (name -> this call's tensor): ``bound(**tensors)``.

    Calls go through ``launch`` (:class:`TritonLaunch`) until one has run a compiled
    kernel after :meth:`keep`; later calls hand that kernel's runner the arguments' values
    with the slots' addresses put in, skipping the per-argument specialisation (~35
    arguments cost the quantization launch most of its host time). Each slot's tensor must
    keep the dtype and device of the first call's (the caller's cache key, e.g. an
    ``AttnCall``, fixes them); an address whose 16-byte alignment differs from the first
    call's goes through ``launch`` again.
    """

    def __init__(
        self,
        launch: TritonLaunch,
        grid: tuple[int, ...],
        args: Sequence[object],
        kwargs: dict[str, object],
        slots: dict[str, torch.Tensor | None],
    ) -> None:
        super().__init__(args, slots)
        self.launch, self.grid, self.kwargs = launch, grid, kwargs
        self._runner: Callable | None = None
        self._aligned: list[tuple[int, str, bool]] = []  # (position, slot, 16-byte aligned)
        self._values: list[object] | None = None  # the runner's arguments, slots left open

    def __call__(self, **tensors: torch.Tensor | None) -> None:
        if self._runner is not None:
            values = self._values if self._values is not None else self._runner_values()
            values = values.copy()
            for pos, name, aligned in self._aligned:
                values[pos] = address = tensors[name].data_ptr()
                if (address % 16 == 0) != aligned:
                    break
            else:
                self._runner(*values)
                return
        args = self.filled(tensors)
        runner = self.launch(self.grid, *args, **self.kwargs)
        if runner is not None and self.slots is None and self.reusable and self._runner is None:
            self._aligned = [(pos, name, args[pos].data_ptr() % 16 == 0)
                             for pos, name in self.positions]  # fmt: skip
            self._runner = runner

    def _runner_values(self) -> list[object]:
        """The runner's arguments (tensors as addresses), made at the first reuse."""
        values = launch_values(self.launch.kernel, self.args, self.kwargs)
        assert values is not None  # the launch found a runner: every parameter was given
        for pos, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                values[pos] = value.data_ptr()
        self._values = values
        return values


def round_debug_p_(buffer: torch.Tensor) -> None:
    """Round a kernel's debug buffer of ``P'·2^8`` (float32) to P̂ = E4M3 in place: the same
    round-to-nearest-even cast the kernels' ``to_e4m3`` performs (values <= 2^8)."""
    buffer.copy_(buffer.to(torch.float8_e4m3fn).float())


@functools.cache
def interpreted() -> bool:
    """True under Triton's CPU interpreter (3.6), which needs two workarounds: its float ->
    E4M3 cast rounds wrongly (see ``to_e4m3``) and its BF16 ``tl.dot`` returns garbage.
    Read once, as Triton reads ``TRITON_INTERPRET`` when its kernels are defined (every
    launch asking the environment cost ~2 µs)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def pow2_exponent_ceil(amax, FMAX_EXP: tl.constexpr, FMAX_MANT: tl.constexpr):
    """int32 ``ceil(log2(amax / fmax))`` clamped to [-127, 127] (numerics.pow2_exponent_ceil)."""
    bits = amax.to(tl.int32, bitcast=True)
    ea = ((bits >> 23) & 0xFF) - 127
    ma = bits & 0x7FFFFF
    e = ea - FMAX_EXP + (ma > FMAX_MANT).to(tl.int32)
    e = tl.where(ea == -127, -127, e)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def exp2i(e):
    """float32 ``2**e`` for int32 ``e`` in [-126, 127] (built from the exponent field)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, INTERPRET: tl.constexpr):
    """Round-to-nearest-even cast of float32 |x| <= 448 to E4M3.

    The hardware cast (GPU) is exact RNE. Triton's CPU interpreter rounds wrongly (ties away,
    a mantissa carry is lost: 7.875 -> 4, and -0 becomes +0), so with INTERPRET the code is
    built from bits: round |x| to its E4M3 quantum 2^(max(E, -6) - 3) with the magic-number
    RNE add, then assemble sign, exponent field and mantissa. Both saturate ±Inf to ±448
    (the GPU's ``satfinite`` cast) and keep NaN (0x7F). Both take the code's sign bit from
    x's, so -0.0 and negatives that round to zero give 0x80, as the twin's torch cast does
    (DESIGN N1).
    """
    if INTERPRET:
        nan = x != x
        x = tl.where(nan, 0.0, tl.minimum(tl.maximum(x, -448.0), 448.0))  # ±Inf -> ±448
        e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        shift = tl.maximum(e, -6) - 3
        mag = ((tl.abs(x) * exp2i(-shift) + 12582912.0) - 12582912.0) * exp2i(shift)
        mag_bits = mag.to(tl.int32, bitcast=True)
        e_mag = ((mag_bits >> 23) & 0xFF) - 127
        normal = ((e_mag + 7) << 3) | ((mag_bits >> 20) & 7)
        sub = (mag * 512.0).to(tl.int32)  # subnormal: multiples of 2^-9 below 2^-6
        sign = tl.where(x.to(tl.int32, bitcast=True) < 0, 128, 0)  # -0.0 too
        code = tl.where(e_mag >= -6, normal, sub) | sign
        code = tl.where(nan, 0x7F, code)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def e4m3_value(x):
    """float32 value of ``E4M3(x)`` (round to nearest even) for ``x >= 0``, from float and
    integer operations only (no FP8 conversion, which Triton 3.6 mis-lays out on sm_90 when
    the result is widened back): normals keep 3 mantissa bits, values below 2^-6 round to
    multiples of 2^-9 (the subnormals), values above 448 saturate to 448 as ``to_e4m3``
    and the twin's cast do (a normaliser summing 2^16 where P̂ holds 448 shrank O ~146x
    once logits reached 2^27). NaN is not kept: the GPU's NaN (0x7FFFFFFF) rounds to -0.0
    (H200, 2026-12-05), the interpreter's (0x7FC00000) stays NaN."""
    x = tl.where(x > 448.0, 448.0, x)
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    return tl.where(x < 0.015625, (x + 24576.0) - 24576.0, normal)


@triton.jit
def e4m3_signed_value(x):
    """``e4m3_value`` of either sign (±448 beyond; NaN stays NaN)."""
    return tl.where(x < 0, -e4m3_value(-x), e4m3_value(x))


@triton.jit
def bf16_operand(x, INTERPRET: tl.constexpr):
    """``x`` (values exact in BF16) as a BF16 ``tl.dot`` operand; float32 under Triton 3.6's
    interpreter, which keeps BF16 as uint16 and multiplies those raw integers in a dot."""
    if INTERPRET:
        x = x.to(tl.float32)
    else:
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def to_bf16(x, INTERPRET: tl.constexpr):
    """Round-to-nearest-even cast of float32 to BF16 (the interpreter's cast truncates, so
    there the rounding is done on the bits first)."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def to_out(x, out_ptr, INTERPRET: tl.constexpr):
    """float32 ``x`` in the element type of ``out_ptr`` (RNE, also under the interpreter)."""
    if out_ptr.dtype.element_ty == tl.bfloat16:
        return to_bf16(x, INTERPRET)
    return x.to(out_ptr.dtype.element_ty)


@triton.jit
def e4m3_ceil(y):
    """Smallest E4M3 value >= y for 0 <= y <= 448 (numerics.e4m3_ceil)."""
    ey = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    shift = tl.maximum(ey, -6) - 3
    return tl.math.ceil(y * exp2i(-shift)) * exp2i(shift)


@triton.jit
def nvfp4_block_scale(t):
    """Smallest E4M3 ``c`` with ``6*c >= t`` (numerics.nvfp4_block_scale), float32."""
    low = e4m3_ceil(t * (1.0 / 6.0) * (1.0 - 1.0 / 1048576.0))
    el = ((low.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    up = low + exp2i(tl.maximum(el, -6) - 3)
    return tl.where(6.0 * low >= t, low, up)


@triton.jit
def e4m3_next_down(c):
    """Largest E4M3 value below ``c`` (E4M3 values >= 2^-9), floored at 2^-9
    (numerics.e4m3_next_down)."""
    bits = c.to(tl.int32, bitcast=True)
    ec = ((bits >> 23) & 0xFF) - 127
    step = exp2i(tl.maximum(ec, -6) - 3)
    step = tl.where(((bits & 0x7FFFFF) == 0) & (ec > -6), step * 0.5, step)
    return tl.maximum(c - step, 0.001953125)


@triton.jit
def e2m1_ratio(groups, scale):
    """``groups`` ``[R, G, 16]`` over ``scale`` ``[R, G]`` (IEEE division), clamped to ±6; 0
    where the scale is 0 (numerics.e2m1_ratio)."""
    safe = tl.where(scale > 0, scale, 1.0)
    ratio = tl.math.div_rn(groups, safe[:, :, None])
    return tl.minimum(tl.maximum(tl.where(scale[:, :, None] > 0, ratio, 0.0), -6.0), 6.0)


@triton.jit
def nvfp4_group_error(groups, scale, unit):
    """int32 squared error of ``groups`` ``[R, G, 16]`` coded with ``scale`` ``[R, G]``, in
    ``unit`` ``[R, G, 1]`` per element, truncated and capped (numerics.nvfp4_group_scale)."""
    _, e2m1 = e2m1_quantize(e2m1_ratio(groups, scale))
    units = tl.abs(e2m1 * scale[:, :, None] - groups) * unit
    units = tl.where(units < NVFP4_ERROR_CAP, units, NVFP4_ERROR_CAP).to(tl.int32)
    return tl.sum(units * units, axis=2)


@triton.jit
def nvfp4_scale_search(groups, scale, CANDIDATES: tl.constexpr):
    """The block scale of least squared error among ``scale`` (the round-up one) and the
    next ``CANDIDATES - 1`` E4M3 values below it, the earliest on a tie; ``groups`` ``[R, G,
    16]`` float32 clamped to ±2688 (numerics.nvfp4_group_scale)."""
    e0 = ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    unit = exp2i(tl.minimum(NVFP4_ERROR_BITS - e0, 127))[:, :, None]
    best = scale
    best_err = nvfp4_group_error(groups, scale, unit)
    c = scale
    for _ in tl.static_range(CANDIDATES - 1):
        c = tl.where(c > 0, e4m3_next_down(c), c)
        err = nvfp4_group_error(groups, c, unit)
        better = err < best_err
        best = tl.where(better, c, best)
        best_err = tl.where(better, err, best_err)
    return best


@triton.jit
def e2m1_round(v):
    """``v`` (float32, 0 <= v <= 6) rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3,
    4, 6), ties to the even code: below 1 by the magic-number add (quantum 0.5), from 1 on
    by rounding the mantissa to its top bit (a carry steps the exponent). The same as
    ``numerics.e2m1_encode``'s thresholds at the midpoints, in 7 operations."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) & -0x400000).to(tl.float32, bitcast=True)
    return tl.where(v < 1.0, (v + 6291456.0) - 6291456.0, normal)


@triton.jit
def e2m1_magnitude_code(r):
    """int32 E2M1 code (0..7) of a magnitude on the E2M1 grid: from 1 on its float's
    exponent and top mantissa bit (``bits >> 22`` is 254..259 for 1..6), 0.5 -> 1, 0 -> 0;
    NaN -> 0, as the threshold rule gives (every comparison false)."""
    top = r.to(tl.int32, bitcast=True) >> 22
    return tl.where(r >= 1.0, top - 252, (r > 0.0).to(tl.int32))


@triton.jit
def e2m1_quantize(x):
    """Round-to-nearest-even E2M1 of float32 |x| <= 6: its code (uint8, bit 3 = sign: x < 0,
    so -0.0 gets 0x0 and a negative that rounds to zero 0x8) and the float32 value the code
    stands for (``e2m1_decode`` of it, bit for bit: 0x8 is -0.0; NaN stays NaN). The sign is
    set on the bits: Triton's unary minus is ``0 - x``, which leaves +0.0 positive."""
    rounded = e2m1_round(tl.abs(x))
    negative = x < 0
    code = e2m1_magnitude_code(rounded).to(tl.uint8) | (negative.to(tl.uint8) << 3)
    value = rounded.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)
    return code, value.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_decode(code):
    """float32 value of E2M1 codes (uint8 in [0, 15]), bit for bit ``numerics.e2m1_decode``'s:
    bit 3 becomes the sign bit, so 0x8 is -0.0."""
    c = code.to(tl.int32)
    exp_field = (c >> 1) & 3
    mant = (c & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mant) * exp2i(exp_field - 1)
    mag = tl.where(exp_field == 0, 0.5 * mant, normal)
    return (mag.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def nvfp4_values(packed, scale, ROWS: tl.constexpr, D: tl.constexpr):
    """float32 ``[ROWS, D]``: packed E2M1 codes ``[ROWS, D/2]`` (low nibble = even element)
    times their block scales ``[ROWS, D/16]`` (float32 E4M3 values), without the per-row
    power of two; exact (at most 6 significant bits, so exact in BF16 too)."""
    vals = tl.join(e2m1_decode(packed & 0xF), e2m1_decode(packed >> 4))
    vals = tl.reshape(vals, (ROWS, D // 16, 16)) * scale[:, :, None]
    return tl.reshape(vals, (ROWS, D))


# ceil(log2(amax / FMAX)) constants: FMAX = (1 + MANT / 2**23) * 2**EXP
E4M3_EXP = tl.constexpr(8)  # 448 = 1.75 * 2**8
E4M3_MANT = tl.constexpr(0x600000)
NVFP4_EXP = tl.constexpr(11)  # 2688 = 6 * 448 = 1.3125 * 2**11
NVFP4_MANT = tl.constexpr(0x280000)
NVFP4_ERROR_BITS = tl.constexpr(_NVFP4_ERROR_BITS)
V_ZERO_EXPONENT = tl.constexpr(_V_ZERO_EXPONENT)
NVFP4_ERROR_CAP = tl.constexpr(float(_NVFP4_ERROR_CAP))


@triton.jit
def fp8_rows(x, PER_TOKEN: tl.constexpr, INTERPRET: tl.constexpr):
    """E4M3 codes and int32 exponents of a ``[BLOCK, D]`` fp32 tile: one exponent per row
    (PER_TOKEN) or one for the whole tile (token block)."""
    amax = tl.max(tl.abs(x), axis=1)
    if not PER_TOKEN:
        amax = tl.zeros_like(amax) + tl.max(amax, axis=0)
    e = pow2_exponent_ceil(amax, E4M3_EXP, E4M3_MANT)
    codes = to_e4m3(x * exp2i(-e)[:, None], INTERPRET)
    return codes, e


@triton.jit
def v_row_exponents(x, e):
    """``e`` with all-zero rows of ``x`` at ``V_ZERO_EXPONENT`` (numerics.quantize_fp8's
    ``zero_exponent`` for V, N3)."""
    return tl.where(tl.max(tl.abs(x), axis=1) == 0.0, V_ZERO_EXPONENT, e)


@triton.jit
def hadamard_rows(x, BLOCK: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """Unnormalized Walsh–Hadamard transform of each row (numerics.hadamard_transform)."""
    for i in tl.static_range(LOG2_D):
        # pairs at distance 2**i: [BLOCK, D / 2**(i+1), 2, 2**i]
        y = tl.reshape(x, (BLOCK, D // (2 << i), 2, 1 << i))
        y = tl.permute(y, (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (BLOCK, D))
    return x


@triton.jit
def nvfp4_rows(
    x, BLOCK: tl.constexpr, D: tl.constexpr, SECOND_LEVEL: tl.constexpr,
    SCALE_CANDIDATES: tl.constexpr,
):  # fmt: skip
    """NVFP4 of a ``[BLOCK, D]`` fp32 tile: packed codes ``[BLOCK, D/2]`` uint8, E4M3 block
    scales ``[BLOCK, D/16]`` (float32 values; ``SCALE_CANDIDATES`` as
    ``numerics.nvfp4_group_scale``'s ``candidates``), per-row int32 exponents (0 without
    SECOND_LEVEL: block scales then saturate at 448, numerics.quantize_nvfp4) and the
    values ``[BLOCK, D]`` the codes stand for without the exponents (E2M1 value x block
    scale, float32, exact: :func:`nvfp4_values` of the codes)."""
    x16 = tl.reshape(x, (BLOCK, D // 16, 16))
    amax16 = tl.max(tl.abs(x16), axis=2)
    e = pow2_exponent_ceil(tl.max(amax16, axis=1), NVFP4_EXP, NVFP4_MANT)
    if not SECOND_LEVEL:
        e = tl.zeros_like(e)
    p2 = exp2i(-e)
    scale = nvfp4_block_scale(tl.minimum(amax16 * p2[:, None], 2688.0))
    scaled = x16 * p2[:, None, None]
    if SCALE_CANDIDATES > 1:
        clamped = tl.minimum(tl.maximum(scaled, -2688.0), 2688.0)
        scale = nvfp4_scale_search(clamped, scale, SCALE_CANDIDATES)
    codes, e2m1 = e2m1_quantize(e2m1_ratio(scaled, scale))
    low, high = tl.split(tl.reshape(codes, (BLOCK, D // 2, 2)))
    values = tl.reshape(e2m1 * scale[:, :, None], (BLOCK, D))
    return low | (high << 4), scale, e, values
