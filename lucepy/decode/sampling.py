"""Samplers: turn next-token logits into a token."""

from __future__ import annotations

import numpy as np


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))
