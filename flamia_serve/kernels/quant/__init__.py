"""Fused Q/K/V quantization (Triton) and its launcher."""
