"""Pallas kernels, each beside its pure-jnp reference (imported as ``kvjax.kernels``)."""
