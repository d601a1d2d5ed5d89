"""Plain-PyTorch reference twins: the executable specification kernels are tested against."""

from flamia_serve.reference.float64 import attention_float64, per_tensor_fp8_attention
from flamia_serve.reference.quantized import (
    QuantizedQKV,
    attention,
    attention_backward,
    attention_forward,
    quantize_qkv,
)

__all__ = [
    "QuantizedQKV",
    "attention",
    "attention_backward",
    "attention_float64",
    "attention_forward",
    "per_tensor_fp8_attention",
    "quantize_qkv",
]
