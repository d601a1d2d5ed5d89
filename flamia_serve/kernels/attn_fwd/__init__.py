"""FP8 attention forward for packed documents (Triton) and its launcher."""
