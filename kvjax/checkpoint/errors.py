"""Errors raised while finding, reading or converting checkpoints."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match its config."""
