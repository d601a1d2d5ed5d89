"""Training path: FLAMIA attention as an ``nn.Module`` and as a transformers attention.

* ``flamia_attention`` / ``FlamiaAttention``: differentiable attention over packed documents
  that runs the GPU kernels on CUDA tensors and the plain-PyTorch twin (same numerics)
  elsewhere.
* ``flamia_serve.train.hf.register()``: ``attn_implementation="flamia"`` for transformers
  5.x models (imports transformers only when called).
* ``flamia_serve.train.pretrain``: the pretraining comparison entry point.
"""

from flamia_serve.train.module import FlamiaAttention, flamia_attention

__all__ = ["FlamiaAttention", "flamia_attention"]
