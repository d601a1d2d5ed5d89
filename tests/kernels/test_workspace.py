"""Eager calls with a plan reuse its checked call, kernel buffers (``PackWorkspace``) and
prepared launches (``AttnCall.prepared``, ``BoundLaunch``), and launch Triton kernels past
the binder (``TritonLaunch``): the results must be those of fresh buffers, bit for bit,
whatever ran before on the same buffers and whatever tensors the first call passed."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from flamia_serve import flamia_attn_varlen, plan_varlen
from flamia_serve.kernels import _common
from flamia_serve.kernels._common import BoundCall, BoundLaunch, TritonLaunch
from flamia_serve.kernels.workspace import TICKETS, PackWorkspace, pack_constant
from flamia_serve.probes import make_pack

LENS = (5, 130, 1, 40)  # padding columns after every document, a 1-token one


def _step(q, k, v, cu, ms, plan, d_out, **opts) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = flamia_attn_varlen(*leaves, cu, ms, plan=plan, **opts)
    out.backward(d_out)
    return [out.detach(), *(x.grad for x in leaves)]


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    if exact:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:  # dQ on a GPU: FP32 atomics sum in any order
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3, equal_nan=True)


@pytest.mark.parametrize(
    "recipe, exact_causal, causal",
    [("mxfp8", False, True), ("mixed_nvfp4", True, False)],
)
def test_reused_buffers_give_the_fresh_buffers_results(recipe, exact_causal, causal, device):
    """Two steps on one plan (the first with a NaN and huge values in a document) against
    the same steps on plans that keep nothing: outputs and gradients bit for bit (dQ up to
    the GPU's atomics order); the workspace stops growing after the first step and nothing
    returned lives in it."""
    opts = {"recipe": recipe, "exact_causal": exact_causal, "causal": causal}
    reused = None
    sizes = []
    for seed in (1, 2):
        q, k, v, cu, ms = make_pack(LENS, 4, 2, 64, seed=seed, device=device)
        d_out = make_pack(LENS, 4, 2, 64, seed=seed + 10, device=device)[0]
        if seed == 1:
            v[3, 1, 5] = float("nan")
            k[140, 0] *= 1e4
        if reused is None:
            reused = plan_varlen(cu, q.shape[0], ms)
        fresh = plan_varlen(cu, q.shape[0], ms, reuse=False)
        cu_reused = reused.cu_seqlens
        got = _step(q, k, v, cu_reused, ms, reused, d_out, **opts)
        want = _step(q, k, v, cu, ms, fresh, d_out, **opts)
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
            _same(a, b, exact=device == "cpu" or name != "dq")
        sizes.append(reused.workspace_bytes())
        held = {b.untyped_storage().data_ptr() for ws in reused._workspaces.values()
                for b in ws._buffers.values()}  # fmt: skip
        assert not held & {t.untyped_storage().data_ptr() for t in got}
        assert fresh.workspace_bytes() == 0 and not fresh.calls
    assert sizes[0] > 0 and sizes[0] == sizes[1]
    assert len(reused.calls) == 1
    (call,) = reused.calls.values()  # the second step reused the first one's launches
    kept = {key[0]: launch for key, launch in call.prepared.items()}
    assert set(kept) == {"fwd", "bwd"} and kept["bwd"].attend is not None


def test_plan_call_cache_follows_the_arguments(device) -> None:
    """A reused call is keyed by what it was checked for: another dtype, head count or
    option is checked and planned again (and a bad one still raises)."""
    q, k, v, cu, ms = make_pack(LENS, 4, 2, 64, seed=1, device=device)
    plan = plan_varlen(cu, q.shape[0], ms)
    with torch.no_grad():
        a = flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
        b = flamia_attn_varlen(q, k, v, cu, ms, plan=plan, causal=False)
        assert len(plan.calls) == 2 and not torch.equal(a, b)
        c = flamia_attn_varlen(q.half(), k.half(), v.half(), cu, ms, plan=plan)
        assert c.dtype == torch.float16 and len(plan.calls) == 3
        with pytest.raises(ValueError, match="multiple of k/v heads"):
            flamia_attn_varlen(q[:, :3], k, v, cu, ms, plan=plan)
        with pytest.raises(TypeError, match=r"q must be a torch\.Tensor"):
            flamia_attn_varlen(None, k, v, cu, ms, plan=plan)


def test_batched_calls_keep_the_last_shapes_plan(device) -> None:
    """``flamia_attn`` keeps the plan of the last [B, S] per device: a later step of the same
    shape reuses it (schedules, checked calls, buffers) and gives a fresh one-call plan's
    outputs and gradients (dQ up to the GPU's atomics order); shapes alternating A, B, A
    each get their own schedules; ``release_kept_plans`` drops it."""
    from flamia_serve import attention

    attention.release_kept_plans()

    def fresh(q, k, v):  # the batched call on a one-call plan (what flamia_attn did before)
        b, s = q.shape[:2]
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        plan = plan_varlen(cu, b * s, s, reuse=False)
        flat = (x.flatten(0, 1) for x in (q, k, v))
        return flamia_attn_varlen(*flat, cu, s, plan=plan).view(q.shape)

    shapes = [(2, 40), (3, 17), (2, 40)]
    plans = []
    for step, (b, s) in enumerate(shapes):
        q, k, v, _cu, _ms = make_pack([s] * b, 4, 2, 64, seed=20 + step, device=device)
        d_out = torch.randn(b, s, 4, 64, device=device).to(q.dtype)
        q, k, v = (x.view(b, s, *x.shape[1:]) for x in (q, k, v))
        results = []
        for attend in (attention.flamia_attn, fresh):
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            out = attend(*leaves)
            out.backward(d_out)
            results.append([out.detach(), *(x.grad for x in leaves)])
        for name, a, b_ in zip(("o", "dq", "dk", "dv"), *results, strict=True):
            _same(a, b_, exact=device == "cpu" or name != "dq")
        (plan,) = attention._BATCHED_PLANS.values()
        assert (plan.total_tokens, plan.max_seqlen) == (b * s, s) and plan.reuse and plan.calls
        plans.append(plan)
        again = attention.flamia_attn(q, k, v)  # same shape: the same plan, no new call
        assert attention._BATCHED_PLANS[q.device] is plan and len(plan.calls) == 2
        torch.testing.assert_close(again, results[0][0], rtol=0, atol=0)
    assert plans[0] is not plans[1] and plans[2] is not plans[0]  # only the last shape kept
    attention.release_kept_plans()
    assert not attention._BATCHED_PLANS


def test_calls_without_a_plan_keep_one_for_their_pack(device) -> None:
    """Eager calls without a plan keep one for the last ``cu_seqlens`` tensor per device:
    layers passing the same tensor reuse it (checked once) with a one-call plan's results;
    ``cu_seqlens`` changed in place, another tensor, another ``max_seqlen`` or token count
    plan again; a bad ``cu_seqlens`` still raises by name."""
    from flamia_serve import attention

    attention.release_kept_plans()
    q, k, v, cu, ms = make_pack(LENS, 4, 2, 64, seed=31, device=device)
    with torch.no_grad():
        want = flamia_attn_varlen(q, k, v, cu, ms, plan=plan_varlen(cu, q.shape[0], ms,
                                                                      reuse=False))  # fmt: skip
        outs = [flamia_attn_varlen(q, k, v, cu, ms) for _ in range(3)]
        (plan,) = attention._VARLEN_PLANS.values()
        assert plan.cu_seqlens is cu and len(plan.calls) == 1
        for out in outs:
            _same(out, want, exact=True)
        flamia_attn_varlen(q, k, v, cu, ms + 1)  # another max_seqlen: planned again
        assert attention._VARLEN_PLANS[q.device] is not plan
        other = cu.clone()
        other[1] = 7  # a new pack in another tensor
        got = flamia_attn_varlen(q, k, v, other, ms)
        again = flamia_attn_varlen(q, k, v, other, ms, plan=plan_varlen(other, q.shape[0], ms))
        _same(got, again, exact=True)
        assert attention._VARLEN_PLANS[q.device].cu_seqlens is other
        other[1] = 9  # the same tensor changed in place: planned again, not stale
        got = flamia_attn_varlen(q, k, v, other, ms)
        fresh = plan_varlen(other.clone(), q.shape[0], ms)
        _same(got, flamia_attn_varlen(q, k, v, fresh.cu_seqlens, ms, plan=fresh), exact=True)
        with pytest.raises(ValueError, match="q must have 3 dims"):  # with a plan kept
            flamia_attn_varlen(q[0, 0, 0], k, v, other, ms)
        bad = cu.clone()
        bad[2] = 2  # below cu[1]
        with pytest.raises(ValueError, match="non-decreasing"):
            flamia_attn_varlen(q, k, v, bad, ms)
    attention.release_kept_plans()
    assert not attention._VARLEN_PLANS


def test_prepared_forward_per_input_layout(device) -> None:
    """A plan's call keeps one prepared forward per input layout: later calls of the same
    layout with other values reuse it and give a fresh call's outputs bit for bit; q/k/v as
    views of one fused projection (other strides) get their own; none keeps the tensors of
    the call that prepared it alive."""
    q, k, v, cu, ms = make_pack(LENS, 4, 2, 64, seed=4, device=device)
    plan = plan_varlen(cu, q.shape[0], ms)
    fresh = plan_varlen(cu, q.shape[0], ms, reuse=False)
    with torch.no_grad():
        first = [x.clone() for x in (q, k, v)]
        probe = weakref.ref(first[0])
        flamia_attn_varlen(*first, cu, ms, plan=plan)
        del first
        gc.collect()
        assert probe() is None  # the prepared launches keep no input alive
        for seed in (5, 6):
            q, k, v = make_pack(LENS, 4, 2, 64, seed=seed, device=device)[:3]
            got = flamia_attn_varlen(q, k, v, cu, ms, plan=plan, return_stats=True)
            want = flamia_attn_varlen(q, k, v, cu, ms, plan=fresh, return_stats=True)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        (call,) = plan.calls.values()
        assert len(call.prepared) == 1
        fused = torch.cat([q, k, v], dim=1)  # [T, Hq + 2·Hkv, d]: token stride 8·64
        views = fused[:, :4], fused[:, 4:6], fused[:, 6:]
        got = flamia_attn_varlen(*views, cu, ms, plan=plan)
        torch.testing.assert_close(got, want[0], rtol=0, atol=0, equal_nan=True)
        assert len(call.prepared) == 2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lens, d, recipe",
    [
        ((300, 1, 700, 47), 128, "mxfp8"),  # the CuTe forward quantizes Q itself (q slot)
        ((300, 1, 700, 47), 128, "mixed_nvfp4"),  # widened NVFP4 operands
        ((300, 1, 700, 47), 256, "mxfp8_grad_input"),  # BF16 row operands, own layout
        ((3, 9, 1, 17, 5, 30, 2, 11) * 8, 64, "mxfp8"),  # short documents: window kernel
    ],
)
def test_gpu_prepared_launches_reused_across_steps(lens, d, recipe) -> None:
    """Steps of several layers on one plan reuse the prepared forward and backward launches
    (compiled kernels called with each call's tensors): every step's outputs and gradients
    are a fresh plan's (dQ up to the atomics' order), whatever the previous step left."""
    q, k, v, cu, ms = make_pack(lens, 8, 2, d, seed=7, device="cuda")
    plan = plan_varlen(cu, q.shape[0], ms)
    fresh = plan_varlen(cu, q.shape[0], ms, reuse=False)
    for step in range(3):
        q, k, v = make_pack(lens, 8, 2, d, seed=8 + step, device="cuda")[:3]
        d_out = make_pack(lens, 8, 2, d, seed=20 + step, device="cuda")[0]
        for _layer in range(2):  # the second layer's q is a fresh tensor of the same layout
            got = _step(q, k, v, cu, ms, plan, d_out, recipe=recipe)
            want = _step(q, k, v, cu, ms, fresh, d_out, recipe=recipe)
            for name, a, b in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
                _same(a, b, exact=name != "dq")
            q = got[0].clone()
    (call,) = plan.calls.values()
    assert {key[0] for key in call.prepared} == {"fwd", "bwd"}


class _RecordingLaunch(TritonLaunch):
    """A ``TritonLaunch`` stand-in: records the launches that go through it (tensors by
    ``id``, keeping none alive) and hands out a runner that records what it is given (as a
    compiled kernel's would take it)."""

    def __init__(self) -> None:
        self.kernel = SimpleNamespace(arg_names=["x", "out", "n", "w", "BLOCK"])
        self.launched: list[tuple] = []
        self.ran: list[tuple] = []

    def __call__(self, grid, *args, **kwargs):
        self.launched.append(tuple(id(a) if isinstance(a, torch.Tensor) else a for a in args))
        return lambda *values: self.ran.append(values)


def test_bound_launch_puts_each_slot_in_place() -> None:
    """The first call goes through the launch with the given tensors; later ones hand the
    runner every value with the slots' addresses in place; an address of another 16-byte
    alignment goes through the launch again; the slots' first tensors are not kept; a
    launch where one tensor fills two slots is never reused (its slots cannot be told
    apart: every call goes through the launch)."""
    launch = _RecordingLaunch()
    x, out, w = torch.zeros(8), torch.zeros(8), torch.ones(4)
    bound = BoundLaunch(launch, (4,), (x, out, 7, w), {"BLOCK": 64}, {"x": x, "out": out})
    assert bound.keep() and bound.positions == [(0, "x"), (1, "out")]
    probe = weakref.ref(x)
    bound(x=x, out=out)
    assert len(launch.launched) == 1 and launch.launched[0][0] == id(x)
    del x
    gc.collect()
    assert probe() is None
    x2, out2 = torch.zeros(8), torch.zeros(8)
    bound(x=x2, out=out2)
    assert launch.ran == [(x2.data_ptr(), out2.data_ptr(), 7, w.data_ptr(), 64)]
    shifted = torch.zeros(9)[1:]
    assert shifted.data_ptr() % 16 != 0
    bound(x=shifted, out=out2)
    assert len(launch.ran) == 1 and launch.launched[-1][0] == id(shifted)
    both = BoundLaunch(launch, (4,), (w, w, 7, w), {"BLOCK": 64}, {"x": w, "out": w})
    assert not both.keep()
    for _ in range(2):
        both(x=w, out=w)
    assert len(launch.ran) == 1 and launch.launched[-2:] == [(id(w), id(w), 7, id(w))] * 2


def test_bound_call_puts_each_slot_in_place() -> None:
    calls = []
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    bound = BoundCall(lambda *args: calls.append(args), [a, b, 3.0, c], {"a": a, "c": c})
    bound(a=a, c=c)  # not kept: the call it was made for
    assert calls[0][0] is a and calls[0][3] is c
    assert bound.keep() and bound.args == [None, b, 3.0, None]
    bound(a=c, c=a)
    assert calls[1][0] is c and calls[1][1] is b and calls[1][3] is a


def test_bound_call_converts_the_tensors_outside_its_slots_once_when_kept() -> None:
    """``fixed`` (the TVM-FFI conversion) is applied once, at ``keep``, to the tensors that
    stay; the slots' tensors pass as given; without slots nothing is converted (TVM-FFI
    would then find no torch tensor to take the stream from)."""
    calls, converted = [], []
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)

    def fixed(t: torch.Tensor) -> tuple:
        converted.append(t)
        return ("converted", t)

    bound = BoundCall(lambda *args: calls.append(args), [a, b, 3.0, c], {"a": a, "c": c}, fixed)
    bound(a=a, c=c)  # made for this call: as given
    assert [x is y for x, y in zip(calls[0], (a, b, 3.0, c), strict=True)] == [True] * 4
    assert not converted
    assert bound.keep() and bound.keep()
    assert len(converted) == 1 and converted[0] is b
    for _ in range(2):
        bound(a=c, c=a)
        assert calls[-1][0] is c and calls[-1][1] == ("converted", b) and calls[-1][3] is a
    assert len(converted) == 1
    alone = BoundCall(lambda *args: calls.append(args), [a, b], {}, fixed)
    assert alone.keep()
    alone()
    assert calls[-1][0] is a and calls[-1][1] is b and len(converted) == 1


def test_unkept_launch_given_other_tensors_binds_them() -> None:
    """A launch made for one call and called with other tensors puts those in (it binds its
    slots then), not the ones it was made with."""
    launch = _RecordingLaunch()
    x, out, w = torch.zeros(8), torch.zeros(8), torch.ones(4)
    bound = BoundLaunch(launch, (4,), (x, out, 7, w), {"BLOCK": 64}, {"x": x, "out": out})
    bound(x=x, out=out)
    other = torch.zeros(8)
    bound(x=other, out=out)
    assert launch.launched == [(id(x), id(out), 7, id(w)), (id(other), id(out), 7, id(w))]


def test_workspace_tickets_are_aligned_zeros_refilled_by_one_memset() -> None:
    ws = PackWorkspace(torch.device("cpu"))
    first = ws.ticket()
    assert first.dtype == torch.int32 and first.shape == (1,) and first.data_ptr() % 16 == 0
    first.fill_(7)  # what a kernel's ticket counter leaves behind
    seen = [first]
    for _ in range(TICKETS - 1):
        t = ws.ticket()
        assert int(t) == 0 and t.data_ptr() % 16 == 0
        seen.append(t)
    assert len({t.data_ptr() for t in seen}) == TICKETS
    again = ws.ticket()  # the ring was used up: zeroed again, the first slot first
    assert again.data_ptr() == first.data_ptr() and int(again) == 0


def test_workspace_buffers_by_name_shape_dtype() -> None:
    ws = PackWorkspace(torch.device("cpu"))
    a = ws.empty("x", (4, 8), torch.float32)
    assert ws.empty("x", (4, 8), torch.float32) is a
    assert ws.empty("x", (4, 9), torch.float32) is not a
    assert ws.empty("y", (4, 8), torch.float32) is not a
    z = ws.zeroed("x", (4, 8), torch.float32)
    assert z is not a and not bool(z.any())
    z.fill_(1)
    assert ws.zeroed("x", (4, 8), torch.float32) is z  # zeroed once, kept as written
    assert ws.nbytes() == 4 * (32 + 36 + 32 + 32)


def test_pack_constant_builds_once_per_workspace() -> None:
    builds = []

    def build() -> torch.Tensor:
        builds.append(1)
        return torch.arange(3)

    ws = PackWorkspace(torch.device("cpu"))
    first = pack_constant(ws, ("index", 64), build)
    assert pack_constant(ws, ("index", 64), build) is first and len(builds) == 1
    assert pack_constant(ws, ("index", 32), build) is not first and len(builds) == 2
    assert pack_constant(None, ("index", 64), build) is not first and len(builds) == 3


@pytest.mark.gpu
def test_gpu_misaligned_inputs_and_other_streams() -> None:
    """Inputs at an address Triton did not specialise for (not 16-byte aligned) go through
    the JIT path and still match; a side stream gets its own workspace."""
    q, k, v, cu, ms = make_pack(LENS, 4, 2, 64, seed=2, device="cuda")
    plan = plan_varlen(cu, q.shape[0], ms)
    with torch.no_grad():
        want = flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
        flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
        shifted = flat[1:].view_as(q)
        shifted.copy_(q)
        assert shifted.data_ptr() % 16 != 0
        torch.testing.assert_close(
            flamia_attn_varlen(shifted, k, v, cu, ms, plan=plan), want, rtol=0, atol=0
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
        torch.cuda.current_stream().wait_stream(side)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(plan._workspaces) == 2


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_of_eager_calls_with_a_plan() -> None:
    """An eager call captured into a CUDA graph uses its own buffers (not the workspace,
    whose ticket ring a replay would not refill): replays match eager calls."""
    q, k, v, cu, ms = make_pack(LENS, 4, 2, 64, seed=3, device="cuda")
    plan = plan_varlen(cu, q.shape[0], ms)
    with torch.no_grad():
        want = flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on the capture stream
            flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(flamia_attn_varlen(q, k, v, cu, ms, plan=plan), want,
                                   rtol=0, atol=0)  # fmt: skip


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)


@pytest.mark.gpu
def test_gpu_triton_launch_reuses_a_specialisation_and_checks_the_rest() -> None:
    """Repeated launches of one specialisation take the compiled kernel (one entry);
    another alignment or dtype is a new entry with correct results; a CPU tensor goes
    through the JIT path and fails there, with Triton's error, not a crash."""
    launch = TritonLaunch(_scale_kernel)
    x = torch.randn(1000, device="cuda")
    for _ in range(3):
        out = torch.empty_like(x)
        launch((4,), x, out, 1000, 2.0, BLOCK=256)
        assert torch.equal(out, x * 2)
    assert len(launch._runners) == 1
    shifted = torch.randn(1001, device="cuda")[1:]
    assert shifted.data_ptr() % 16 != 0
    out = torch.empty_like(shifted)
    launch((4,), shifted, out, 1000, 2.0, BLOCK=256)
    assert torch.equal(out, shifted * 2) and len(launch._runners) == 2
    half = x.half()
    out = torch.empty_like(half)
    launch((4,), half, out, 1000, 2.0, BLOCK=256)
    assert torch.equal(out, half * 2) and len(launch._runners) == 3
    with pytest.raises(ValueError, match="cpu tensor"):
        launch((4,), x.cpu(), torch.empty_like(x), 1000, 2.0, BLOCK=256)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_bound_launch_runs_the_compiled_kernel_with_new_tensors() -> None:
    """A ``BoundLaunch`` reused with other tensors (the compiled kernel's runner, addresses
    put in) and with a misaligned one (through the launch) writes the right outputs."""
    launch = TritonLaunch(_scale_kernel)
    x = torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    bound = BoundLaunch(launch, (4,), (x, out, 1000, 3.0), {"BLOCK": 256}, {"x": x, "out": out})
    assert bound.keep()
    bound(x=x, out=out)
    assert torch.equal(out, x * 3) and bound._runner is not None
    for _ in range(3):
        x2 = torch.randn(1000, device="cuda")
        out2 = torch.empty_like(x2)
        bound(x=x2, out=out2)
        assert torch.equal(out2, x2 * 3)
    shifted = torch.randn(1001, device="cuda")[1:]
    out3 = torch.empty_like(shifted)
    bound(x=shifted, out=out3)
    assert torch.equal(out3, shifted * 3)


class _FakeCompiled:
    """The parts of a ``CompiledKernel`` that ``compiled_runner`` uses, recording launches."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def run(self, *args: object) -> None:
        self.calls.append(("launcher", args))

    def __getitem__(self, grid):
        return lambda *values: self.calls.append(("triton runner", grid, values))


def test_compiled_runner_calls_the_launcher_unless_a_launch_hook_is_set(monkeypatch) -> None:
    """No hook: the launcher gets the grid, the current stream, no metadata or hooks, then
    the values. A hook in Triton's chain, or one set as a plain function: Triton's runner,
    so the hook sees the launch."""
    calls: list = []
    monkeypatch.setattr(_common, "_current_raw_stream", lambda: 77)
    runner = _common.compiled_runner(_FakeCompiled(calls), (3, 2, 1))
    runner(10, 20)
    assert calls == [("launcher", (3, 2, 1, 77, "function", "metadata", None, None, None, 10, 20))]

    def hook(metadata: object) -> None:
        pass

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        runner(5)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert calls[-1] == ("triton runner", (3, 2, 1), (5,))
    runner(6)
    assert calls[-1][0] == "launcher"
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", hook)
    runner(7)
    assert calls[-1] == ("triton runner", (3, 2, 1), (7,))


@pytest.mark.gpu
def test_gpu_compiled_runner_launches_on_the_current_stream_and_calls_hooks() -> None:
    """The kept runner launches on the stream current at each call (a side stream's kernel
    is ordered after that stream's earlier work) and calls a launch hook when one is set."""
    launch = TritonLaunch(_scale_kernel)
    x = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(x)
    launch((4096,), x, out, x.numel(), 2.0, BLOCK=256)  # compiles; the runner is kept
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            y = x * 3  # queued on the side stream, before the launch reads it
            launch((4096,), y, out, x.numel(), 2.0, BLOCK=256)
    side.synchronize()
    assert torch.equal(out, x * 6) and len(launch._runners) == 1
    seen: list = []

    def hook(metadata: object) -> None:
        seen.append(metadata)

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch((4096,), x, out, x.numel(), 2.0, BLOCK=256)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(seen) == 1 and torch.equal(out, x * 2)
