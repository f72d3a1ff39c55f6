"""Paged-attention kernels and their pure-torch references.

`kernels.reference` holds the plain-torch definitions every kernel is tested against; the
CPU worker runs them directly.
"""

from kernels.reference import AttentionIndex, paged_attention, paged_attention_indexed, write_kv

__all__ = ["AttentionIndex", "paged_attention", "paged_attention_indexed", "write_kv"]
