"""``flamia_serve.probes``' library functions: documents and cuts out of range are named,
never reported as zero leakage."""

from __future__ import annotations

import pytest

from flamia_serve.probes import (
    attention_fn,
    cross_document_leakage,
    future_grad_leakage,
    future_leakage,
    make_pack,
)


def test_negative_cuts_count_from_the_end_and_bad_documents_raise() -> None:
    """``t = -3`` (``LeakageSetup.cuts``' convention) watched no rows and reported 0 for
    mxfp8, which leaks inside a token block; ``doc = -1`` reported 0 too."""
    q, k, v, cu, ms = make_pack((20, 30), 2, 1, 64, seed=1)
    d_out = make_pack((20, 30), 2, 1, 64, seed=2)[0]
    fn = attention_fn("mxfp8", False)
    leak = future_leakage(fn, q, k, v, cu, ms, 1, 30 - 3)
    assert leak > 0
    assert future_leakage(fn, q, k, v, cu, ms, 1, -3) == leak
    assert future_grad_leakage(fn, q, k, v, d_out, cu, ms, 1, -3, block=1) == future_grad_leakage(
        fn, q, k, v, d_out, cu, ms, 1, 27, block=1)
    for doc in (-1, 2, True):
        with pytest.raises(ValueError, match=r"doc must be an int in \[0, 2\)"):
            cross_document_leakage(fn, q, k, v, cu, ms, doc)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="t must be an int >= -30"):
        future_leakage(fn, q, k, v, cu, ms, 1, -31)
