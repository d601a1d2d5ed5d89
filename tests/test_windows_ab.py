"""CPU checks of ``benchmarks/windows_ab.py``'s swap of the forward's window kernel: inside
the block a forward prepared there launches the variant's kernel at the asked warps; the
tree's kernel and warps come back after it, also when the block raises."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.windows_ab import windows_kernel
from flamia_serve.kernels.attn_fwd import ops as fwd_ops
from flamia_serve.kernels.attn_fwd.triton import attn_fwd_kernel
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.probes import make_pack


def _windows_launch(q, k, v, cu):
    """The window launch of a forward prepared now (Triton kernels, windows on)."""
    cfg = dataclasses.replace(fwd_ops.default_config(64, q.device, kernel="triton"), windows=True)
    qkv = quantize_qkv(q, k, v, cu)
    launch = fwd_ops.attn_fwd_launch(qkv, cu, heads_q=2, causal=True, softmax_scale=0.125,
                                     config=cfg)  # fmt: skip
    return launch.windows


def test_a_forward_prepared_inside_launches_the_variants_window_kernel() -> None:
    q, k, v, cu, _ms = make_pack((5, 20, 3, 40), 2, 1, 64, seed=3, device="cpu")
    own = fwd_ops._LAUNCH_WINDOWS, fwd_ops.WINDOW_NUM_WARPS
    variant = attn_fwd_kernel  # any other JIT kernel stands for the variant's
    with windows_kernel(variant, warps=8):
        inside = _windows_launch(q, k, v, cu)
    assert inside.launch.kernel is variant and inside.kwargs["num_warps"] == 8
    after = _windows_launch(q, k, v, cu)
    assert after.launch is own[0] and after.kwargs["num_warps"] == own[1]
    with pytest.raises(RuntimeError, match="inside"), windows_kernel(variant, warps=2):
        raise RuntimeError("inside")
    assert (fwd_ops._LAUNCH_WINDOWS, fwd_ops.WINDOW_NUM_WARPS) == own
    with windows_kernel(warps=2):  # only the warps
        assert fwd_ops._LAUNCH_WINDOWS is own[0] and fwd_ops.WINDOW_NUM_WARPS == 2
