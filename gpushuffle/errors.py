"""Exceptions users may catch."""

from __future__ import annotations


class ShuffleInputError(ValueError):
    """The data cannot be shuffled as given; the message names the fix."""
