"""vLLM attention backend over the FLAMIA serving kernels: ``--attention-backend flamia``.

``register()`` is the ``vllm.general_plugins`` entry point: it puts
:class:`~flamia_serve.backend.vllm_backend.FlamiaAttentionBackend` into vLLM's ``CUSTOM``
backend slot and adds the alias ``FLAMIA`` (``--attention-backend flamia``, any case). vLLM
calls it in every process before it resolves a backend name; calling it again is a no-op.
Importing this package does not import vLLM (only ``register`` and the backend module do).
"""

from __future__ import annotations

BACKEND_NAME = "FLAMIA"
BACKEND_CLASS = "flamia_serve.backend.vllm_backend.FlamiaAttentionBackend"

__all__ = ["BACKEND_CLASS", "BACKEND_NAME", "register"]


def register() -> None:
    """Register the FLAMIA backend with vLLM (idempotent). Needs vLLM 0.26 installed."""
    from flamia_serve.backend._vllm import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)
    # An alias, not a new member: configs are pickled into spawned processes and unpickled
    # before plugins load, so a new member would not exist there; CUSTOM does.
    AttentionBackendEnum._member_map_.setdefault(BACKEND_NAME, AttentionBackendEnum.CUSTOM)
