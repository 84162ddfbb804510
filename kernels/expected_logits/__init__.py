"""Expected Attention's expected logits of every cache slot: a Pallas kernel per platform beside
the XLA reference."""

from kvjax.kernels.expected_logits.api import expected_logits

__all__ = ["expected_logits"]
