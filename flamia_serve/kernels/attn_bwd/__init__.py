"""FP8 attention backward (Triton): one pass over key tiles computes dQ, dK and dV."""
