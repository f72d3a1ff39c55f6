"""Paged-attention kernels and their pure-torch references.

`kernels.reference` holds the plain-torch definitions every kernel is tested against.
"""

from kernels.reference import kv_slots, paged_attention, write_kv

__all__ = ["kv_slots", "paged_attention", "write_kv"]
