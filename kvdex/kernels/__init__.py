"""Attention and gather kernels. Each fast kernel has a PyTorch twin here that is its spec."""

from kvdex.kernels.attention import (
    dense_attention,
    dense_decode_attention,
    paged_decode_attention,
    sparse_decode_attention,
)

__all__ = ["dense_attention", "dense_decode_attention", "paged_decode_attention", "sparse_decode_attention"]
