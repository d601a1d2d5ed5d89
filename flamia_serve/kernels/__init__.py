"""Triton kernels, each beside its launcher; reference twins live in ``flamia_serve.reference``
and ``flamia_serve.numerics``."""
