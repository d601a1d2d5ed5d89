"""Plain-PyTorch reference twins: the executable specification kernels are tested against."""

from flamia_serve.numerics.operands import QuantizedDO, QuantizedQKV
from flamia_serve.reference.float64 import attention_float64, per_tensor_fp8_attention
from flamia_serve.reference.quantized import (
    attention,
    attention_backward,
    attention_forward,
    backward_probs,
    quantize_do,
    quantize_qkv,
)

__all__ = [
    "QuantizedDO",
    "QuantizedQKV",
    "attention",
    "attention_backward",
    "attention_float64",
    "attention_forward",
    "backward_probs",
    "per_tensor_fp8_attention",
    "quantize_do",
    "quantize_qkv",
]
