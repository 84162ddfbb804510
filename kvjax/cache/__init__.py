"""KV caches: the full cache, the dense and paged budget caches, their layout and attention path."""
