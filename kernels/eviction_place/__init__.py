"""A decoding step's eviction: the place, by position, of each (row, KV head)'s lowest eviction key
(the base's pooled aggregate; the dense cache), or its few lowest with their counts (the paged
cache's shared allocations); Triton kernels beside the XLA reference."""

from kvjax.kernels.eviction_place.api import lowest_place, lowest_places
from kvjax.kernels.eviction_place.reference import Lowest

__all__ = ["Lowest", "lowest_place", "lowest_places"]
