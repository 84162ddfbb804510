"""The decoder as plain functions over a parameter pytree: config, parameters, RoPE, the layer
scan."""
