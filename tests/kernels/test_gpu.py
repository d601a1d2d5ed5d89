"""GPU-only checks at realistic sizes (run on the H200: ``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

from flamia_serve import flamia_attn_varlen
from flamia_serve.kernels.attn_fwd.ops import attn_fwd
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.probes import future_leakage, make_pack
from flamia_serve.reference import attention_float64, attention_forward
from tests.kernels.test_attn_fwd import _check_close

pytestmark = pytest.mark.gpu

LENS = (1, 300, 1000, 129, 2048, 31)


@pytest.mark.parametrize("recipe", ["mxfp8", "mixed_nvfp4_hadamard"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_fwd_large_pack_matches_reference(recipe: str, d: int, causal: bool) -> None:
    q, k, v, cu, ms = make_pack(LENS, 32, 8, d, seed=11, device="cuda")
    qkv = quantize_qkv(q, k, v, cu, recipe=recipe)
    out, m, lse = attn_fwd(qkv, cu, heads_q=32, causal=causal, softmax_scale=d**-0.5)
    ref_o, ref_m, ref_lse = attention_forward(
        qkv.to_reference(), cu, heads_q=32, causal=causal, softmax_scale=d**-0.5
    )
    _check_close(out, m, lse, ref_o, ref_m, ref_lse)
    o = out.float()
    exact = attention_float64(q, k, v, cu, ms, causal=causal)
    cos = torch.nn.functional.cosine_similarity(o.flatten().double(), exact.flatten(), dim=0)
    assert float(cos) >= (0.998 if recipe == "mxfp8" else 0.985)


def test_exact_causal_zero_leakage_large() -> None:
    q, k, v, cu, ms = make_pack((700, 1500), 8, 2, 128, seed=12, device="cuda")

    def fn(*args):
        return flamia_attn_varlen(*args, exact_causal=True)

    for t in (0, 129, 1000, 1498):
        assert future_leakage(fn, q, k, v, cu, ms, 1, t) == 0.0
