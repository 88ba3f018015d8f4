"""Fused Metal kernels for the quantized KV cache."""
