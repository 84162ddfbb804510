"""A decoding step's eviction in the dense cache: the place, by position, of each (row, KV head)'s
lowest eviction key (the base's pooled aggregate); a Triton kernel beside the XLA reference."""

from kvjax.kernels.eviction_place.api import lowest_place

__all__ = ["lowest_place"]
