"""``benchmarks/bwd_error_sources.py``: with nothing quantized its emulated gradients are
float64 attention's (autograd), and each switch moves only the gradients it feeds."""

from __future__ import annotations

import torch

from benchmarks.bwd_error_sources import gradients
from flamia_serve.probes import make_pack
from flamia_serve.reference.float64 import _varlen


def _pack():
    q, k, v, cu, ms = make_pack((70, 1, 33), 4, 2, 64, seed=7)
    d_out = make_pack((70, 1, 33), 4, 2, 64, seed=8)[0]
    return q, k, v, cu, ms, d_out


def test_nothing_quantized_is_float64_autograd() -> None:
    q, k, v, cu, _, d_out = _pack()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    _varlen(*leaves, cu, True, 64**-0.5).backward(d_out.double())  # float64 autograd
    got = gradients(q, k, v, d_out, cu, set())
    for name, leaf in zip(("dq", "dk", "dv"), leaves, strict=True):
        assert torch.allclose(got[name], leaf.grad, rtol=1e-9, atol=1e-12), name


def test_each_switch_moves_what_it_feeds() -> None:
    q, k, v, cu, _, d_out = _pack()
    exact = gradients(q, k, v, d_out, cu, set())
    ds = gradients(q, k, v, d_out, cu, {"ds"})  # dS feeds dQ and dK, not dV
    assert torch.equal(ds["dv"], exact["dv"])
    assert not torch.equal(ds["dq"], exact["dq"]) and not torch.equal(ds["dk"], exact["dk"])
    # the unquantized Q in dK, K in dQ: with Q̂/K̂ on, only the scores' part of their error
    qk = gradients(q, k, v, d_out, cu, {"qk"})
    qk_exact = gradients(q, k, v, d_out, cu, {"qk", "exact_q_in_dk", "exact_k_in_dq"})
    assert torch.equal(qk["dv"], qk_exact["dv"])
    for name in ("dq", "dk"):
        err = (qk[name] - exact[name]).norm()
        assert (qk_exact[name] - exact[name]).norm() < err, name
