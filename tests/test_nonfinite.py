"""Non-finite inputs (docs/DESIGN.md, "Non-finite inputs"): a NaN or ±Inf never changes any
output of another document — forward and backward, reference and kernel, bit for bit.
Inside its own document the result is unspecified; the reference's pattern is pinned here
so that a change of it is a decision, not an accident."""

from __future__ import annotations

import pytest
import torch

from flamia_serve import flamia_attn_varlen
from flamia_serve.numerics import E4M3_MAX, Granularity, quantize_fp8
from flamia_serve.probes import attention_fn, forward_backward, make_pack

NAN, INF = float("nan"), float("inf")
DOCS = (40, 70, 30)  # document 1 holds the bad values: tokens 40..109
START, END = 40, 110

# (tensor, token, head, value): the first and last token of document 1 (next to the other
# documents, where a tile or block that crossed a boundary would carry them over), and one
# inside it. "d" is the incoming gradient dO.
CASES = [
    ("q", START, 0, NAN),
    ("q", END - 1, 1, -INF),
    ("k", START, 0, INF),
    ("k", END - 1, 1, NAN),
    ("v", START, 0, NAN),
    ("v", END - 1, 1, INF),
    ("v", START + 50, 0, NAN),
    ("d", START, 0, NAN),
    ("d", END - 1, 3, INF),
]
RECIPES = [("mxfp8", False), ("mxfp8", True), ("mixed_nvfp4", False), ("mxfp8_grad_input", True)]


def _inputs(device: str = "cpu"):
    q, k, v, cu, ms = make_pack(DOCS, 4, 2, 64, seed=0, device=device)
    d_out = make_pack(DOCS, 4, 1, 64, seed=5, device=device)[0]
    return {"q": q, "k": k, "v": v, "d": d_out}, cu, ms


def _with(tensors: dict, name: str, token: int, head: int, value: float) -> dict:
    out = dict(tensors)
    x = tensors[name].clone()
    x[token, head, 3] = value
    out[name] = x
    return out


def _other_docs_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a[:START], b[:START]) and torch.equal(a[END:], b[END:])


@pytest.mark.parametrize(("recipe", "exact"), RECIPES, ids=[f"{r}-exact{e}" for r, e in RECIPES])
@pytest.mark.parametrize("case", CASES, ids=[f"{n}{t}-{v}" for n, t, _, v in CASES])
def test_reference_never_crosses_a_document(recipe: str, exact: bool, case: tuple) -> None:
    t, cu, ms = _inputs()
    fn = attention_fn(recipe, exact)
    base = forward_backward(fn, t["q"], t["k"], t["v"], t["d"], cu, ms)
    bad = _with(t, *case)
    got = forward_backward(fn, bad["q"], bad["k"], bad["v"], bad["d"], cu, ms)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), base, got, strict=True):
        assert _other_docs_equal(a, b), name
    # the bad value did reach its own document (the probe is not vacuous)
    assert any(not torch.equal(a[START:END], b[START:END]) for a, b in zip(base, got, strict=True))


def test_reference_nan_in_v_poisons_its_whole_document_and_kv_group() -> None:
    """Masked (future) keys still enter P̂·V̂ with P̂ = 0, and 0·NaN = NaN: every row of the
    document in the query heads that read that KV head is NaN in that column, earlier rows
    included (the key's other values flushed to 0 under its saturated exponent)."""
    t, cu, ms = _inputs()
    token = START + 50
    bad = _with(t, "v", token, 0, NAN)  # kv head 0 = query heads 0, 1
    out = attention_fn("mxfp8", True)(bad["q"], bad["k"], bad["v"], cu, ms)
    base = attention_fn("mxfp8", True)(t["q"], t["k"], t["v"], cu, ms)
    assert bool(out[START:END, :2, 3].isnan().all())
    assert torch.equal(out[START:END, 2:], base[START:END, 2:])  # the other KV group
    assert _other_docs_equal(out, base)


@pytest.mark.parametrize("name", ["q", "k"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_reference_qk_blocks_bound_the_spread(name: str, value: float) -> None:
    """A bad Q/K value at token p saturates the exponent of its scale group: with
    exact_causal (per-token) no row before p changes; by default no row before p's
    32-token block changes (the block's other values flush to zero)."""
    t, cu, ms = _inputs()
    token = START + 50  # document position 50: block 32..63
    bad = _with(t, name, token, 0, value)
    for exact, first_changed in ((True, token), (False, START + 32)):
        fn = attention_fn("mxfp8", exact)
        base, out = fn(t["q"], t["k"], t["v"], cu, ms), fn(bad["q"], bad["k"], bad["v"], cu, ms)
        assert torch.equal(out[:first_changed], base[:first_changed]), exact
        assert not torch.equal(out[first_changed:END], base[first_changed:END]), exact
        assert torch.equal(out[END:], base[END:])


def test_e4m3_has_no_infinity_inf_saturates() -> None:
    """±Inf or NaN sets its group's exponent to 120 (from its all-ones exponent field), so
    the other values of the group flush to 0; ±Inf's code saturates at ±448, NaN stays NaN."""
    x = torch.ones(4, 1, 64)
    x[1, 0, 3], x[2, 0, 3] = INF, -INF
    x[3, 0, 3] = NAN
    q8 = quantize_fp8(x, torch.tensor([0, 4], dtype=torch.int32), Granularity.TOKEN)
    codes = q8.codes.float()
    assert q8.exponents[1:, 0].tolist() == [120, 120, 120]
    assert codes[1, 0, 3] == E4M3_MAX and codes[2, 0, 3] == -E4M3_MAX
    assert bool(codes[3, 0, 3].isnan())
    assert bool((codes[1:, 0, :3] == 0).all()) and bool((q8.dequantize()[0] == 1).all())


KERNEL_CASES = [CASES[0], CASES[3], CASES[4], CASES[5]]


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize(("recipe", "exact"), RECIPES, ids=[f"{r}-exact{e}" for r, e in RECIPES])
def test_kernel_never_crosses_a_document(device: str, recipe: str, exact: bool) -> None:
    """The forward kernel (Triton; the interpreter on CPU): bad Q, K and V values at both
    edges of document 1 at once leave documents 0 and 2 bit-identical."""
    t, cu, ms = _inputs(device)
    bad = t
    for case in KERNEL_CASES:
        bad = _with(bad, *case)
    kw = {"recipe": recipe, "exact_causal": exact}
    with torch.no_grad():
        base = flamia_attn_varlen(t["q"], t["k"], t["v"], cu, ms, **kw)
        out = flamia_attn_varlen(bad["q"], bad["k"], bad["v"], cu, ms, **kw)
    assert _other_docs_equal(out, base)
    assert not torch.equal(out[START:END], base[START:END])
    for x in (t["q"], t["k"], t["v"]):  # the inputs are not modified
        assert bool(torch.isfinite(x).all())


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_grad_input"])
def test_kernel_backward_never_crosses_a_document(device: str, recipe: str) -> None:
    """The kernel path's backward (the library's default kernels): bad Q, K, V and dO values
    at both edges of document 1 leave dQ, dK, dV of documents 0 and 2 as they were (bit for
    bit; dQ on a GPU up to the order of its FP32 atomics / bulk adds)."""
    t, cu, ms = _inputs(device)
    bad = t
    for case in [*KERNEL_CASES, CASES[7], CASES[8]]:
        bad = _with(bad, *case)
    fn = attention_fn(recipe, False, flamia_attn_varlen)
    base = forward_backward(fn, t["q"], t["k"], t["v"], t["d"], cu, ms)
    got = forward_backward(fn, bad["q"], bad["k"], bad["v"], bad["d"], cu, ms)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got, base, strict=True):
        if name == "dQ" and device == "cuda":
            for sl in (slice(0, START), slice(END, None)):
                assert torch.allclose(a[sl].float(), b[sl].float(), rtol=1e-2, atol=1e-5), name
        else:
            assert _other_docs_equal(a, b), name
        assert bool(torch.isfinite(a[:START]).all()) and bool(torch.isfinite(a[END:]).all())
