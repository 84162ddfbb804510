"""MomentKV's residual norms ‖r_j‖ of every cache slot: a Pallas kernel per platform beside the
XLA reference."""

from kvjax.kernels.moment_residuals.api import moment_residual_norms

__all__ = ["moment_residual_norms"]
