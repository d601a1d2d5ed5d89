"""CuTe DSL helpers shared by the sm_90 kernels (training forward and backward, serving
decodes): the bit-level rules of
``numerics.formats`` (twins of ``kernels._common``'s Triton helpers, operation for operation)
and the register-fragment bookkeeping of Hopper ``wgmma`` accumulators.

Requires ``nvidia-cutlass-dsl`` only; imported only by the CuTe kernels.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import from_dlpack
from cutlass.cutlass_dsl import T, dsl_user_op

FP8 = cutlass.Float8E4M3FN
TVM_FFI = "--enable-tvm-ffi"


def cute_tensor(t: torch.Tensor, align: int):
    """``t`` as a CuTe tensor for TVM-FFI calls (dynamic layout) whose contiguous (stride-1)
    dim is its leading one, assumed ``align``-byte aligned (for compiling against fake or
    real tensors). E4M3 tensors go through DLPack as bytes and are retyped."""
    fp8 = t.dtype == torch.float8_e4m3fn
    tensor = from_dlpack((t.view(torch.uint8) if fp8 else t).detach(), assumed_align=align,
                         enable_tvm_ffi=True)  # fmt: skip
    if fp8:
        tensor.element_type = FP8
    return tensor.mark_layout_dynamic(leading_dim=t.dim() - 1 - t.stride()[::-1].index(1))


def compile_kernel(kernel, aligned, *scalars, options: str = TVM_FFI):
    """``cute.compile`` of ``kernel`` for the (tensor, byte alignment) pairs ``aligned``,
    then the scalars, then the TVM-FFI environment stream."""
    return cute.compile(
        kernel, *(cute_tensor(t, a) for t, a in aligned), *scalars,
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options=options,
    )  # fmt: skip


def ffi_tensor(t: torch.Tensor) -> object:
    """``t`` as a TVM-FFI tensor (same memory, ``t`` kept alive): what a kept ``BoundCall``
    passes for the arguments that stay (``BoundCall(fixed=ffi_tensor)``)."""
    import tvm_ffi  # what the TVM-FFI calls (TVM_FFI) need anyway

    return tvm_ffi.from_dlpack(t)


def kernel_tensors(aligned) -> list[torch.Tensor]:
    """The launch's tensors of ``aligned``: E4M3 ones as bytes (what the kernels declare)."""
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t, _ in aligned]


def column_offset(j: int) -> int:
    """Column of a thread's accumulator value ``j`` (row-major mn view of a Hopper
    accumulator: pairs of adjacent columns, 8 apart) relative to its first, ``col0``."""
    return j % 2 + 8 * (j // 2)


@cute.jit
def pow2(e: Int32) -> Float32:
    """float32 ``2**e`` for int32 ``e`` in [-126, 127], built from the exponent field."""
    return Int32((e + 127) << 23).bitcast(Float32)


@cute.jit
def pow2_exponent_ceil(
    amax: Float32, fmax_exp: cutlass.Constexpr, fmax_mant: cutlass.Constexpr
) -> Int32:
    """int32 ``ceil(log2(amax / fmax))`` clamped to [-127, 127], -127 for zero, for
    ``fmax = (1 + fmax_mant / 2^23)·2^fmax_exp`` (twin of ``kernels._common``'s)."""
    bits = amax.bitcast(Int32)
    ea = ((bits >> 23) & 0xFF) - 127
    ma = bits & 0x7FFFFF
    e = ea - fmax_exp
    e = e + 1 if ma > fmax_mant else e
    e = Int32(-127) if ea == -127 else e
    e = Int32(-127) if e < -127 else e
    return Int32(127) if e > 127 else e


@cute.jit
def e4m3_exponent(amax: Float32) -> Int32:
    """:func:`pow2_exponent_ceil` for E4M3's 448 = 1.75·2^8."""
    return pow2_exponent_ceil(amax, 8, 0x600000)


@cute.jit
def v_t_position(key: Int32) -> Int32:
    """Column of document-local token ``key`` inside its document's span of the column
    layout (twin of ``numerics.operands.v_t_position``)."""
    k = key & 15
    return (key - k) + (((k >> 1) & 3) << 2) + ((k >> 3) << 1) + (k & 1)


@cute.jit
def accumulator_to_a(acc: cute.Tensor, frag: cute.Tensor) -> None:
    """E4M3 of an FP32 ``wgmma`` accumulator (M x N) into the register A fragment of an
    ``M x K=N`` FP8 ``wgmma`` whose B operand stores its K columns in the column layout's
    order (``operands.v_t_position``). Accumulator value (c, h, n8) is column ``8·n8 + 2q +
    c`` of row half h; A value (i, h, g, b) is column-layout position ``32b + 16g + 4q + i``,
    which holds token ``32b + 16g + 8·(i // 2) + 2q + i % 2``: the same token for n8 = 4b +
    2g + i // 2, c = i % 2, so the values move with no data exchange between threads."""
    k_blocks = cute.size(acc, mode=[0]) // 16
    acc_as_a = cute.make_tensor(
        acc.iterator,
        cute.make_layout((((2, 2), 2, 2), 1, k_blocks), stride=(((1, 4), 2, 8), 0, 16)),
    )
    a = cute.make_tensor(
        frag.iterator,
        cute.make_layout((((2, 2), 2, 2), 1, k_blocks), stride=(((1, 2), 4, 8), 0, 16)),
    )
    a.store(acc_as_a.load().to(FP8))


# ---------------------------------------------------------------- PTX helpers
def _asm(result, args, text: str, constraints: str, side_effects: bool = False):
    """Inline PTX; ``side_effects``: kept, and in order with the other such statements."""
    return llvm.inline_asm(
        result, args, text, constraints, has_side_effects=side_effects, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


def _mlir(ty):
    return T.i32() if ty is Int32 else T.f32()


def _fields(res, ty, n: int, loc, ip) -> list:
    return [ty(llvm.extractvalue(_mlir(ty), res, [i], loc=loc, ip=ip)) for i in range(n)]


def _load_words(op: str, addr, addr_c: str, n: int, side_effects: bool, loc,
                ip) -> list[Int32]:  # fmt: skip
    """``n`` (1, 2 or 4) 32-bit words by the load ``op`` (``ld.global.nc``, ``ld.shared``) at
    the address value ``addr`` (constraint ``addr_c``)."""
    if n == 1:
        return [Int32(_asm(T.i32(), [addr], f"{op}.u32 $0, [$1];", f"=r,{addr_c}",
                           side_effects))]  # fmt: skip
    regs = ", ".join(f"${i}" for i in range(n))
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * n), [addr],
        f"{op}.v{n}.u32 {{{regs}}}, [${n}];", ",".join(["=r"] * n) + f",{addr_c}", side_effects,
    )  # fmt: skip
    return _fields(res, Int32, n, loc, ip)


@dsl_user_op
def load_shared_words(addr: Int32, n: int, *, loc=None, ip=None) -> list[Int32]:
    """``n`` (1, 2 or 4) 32-bit words at shared-memory address ``addr`` (aligned to ``4n``);
    ordered after the barriers (``cp.async`` waits, warp or named barriers) that precede
    it."""
    return _load_words("ld.shared", Int32(addr).ir_value(loc=loc, ip=ip), "r", n, True,
                       loc, ip)  # fmt: skip


@dsl_user_op
def store_global_words(addr: Int64, words: list, *, loc=None, ip=None) -> None:
    """Store four 32-bit ``words`` at global byte address ``addr`` (16-byte aligned), one
    ``st.global.v4``."""
    args = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip)
                                                     for w in words]  # fmt: skip
    _asm(None, args, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
         side_effects=True)  # fmt: skip
