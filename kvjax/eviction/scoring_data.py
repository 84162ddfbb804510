"""``ScoringData``: what a scorer with a scoring pass of its own reads besides its static
``Policy``."""

from __future__ import annotations

import numpy as np
from flax import struct

from kvjax.eviction.kvzip import RepeatPrompt


@struct.dataclass
class ScoringData:
    """The data of a scoring pass: a pytree that travels beside the static ``Policy``.

    Fields:
        repeat_prompt: ``kvzip``'s repeat prompt (None for other bases).
        head_scores: [L, Hk] ``kvzip-head``'s saved head scores (None for other bases).
    """

    repeat_prompt: RepeatPrompt | None = None
    head_scores: np.ndarray | None = None

    def key(self) -> tuple:
        """A hashable summary of the data (what a cache of scorer states is keyed on)."""
        scores = None if self.head_scores is None else np.asarray(self.head_scores).tobytes()
        return self.repeat_prompt, scores
