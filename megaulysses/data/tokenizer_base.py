"""The interface every tokenizer keeps (its own module: tokenizer.py builds the types, and
the types in other modules, hf_tokenizer.py, derive from this without importing it back)."""

from __future__ import annotations

from typing import Iterable, SupportsInt


class Tokenizer:
    """Interface the data tools and the trainer rely on."""

    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        raise NotImplementedError
