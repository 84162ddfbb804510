"""Running the model: prefill protocols, decoding, contexts, sampling, options, KVzip's pass."""
