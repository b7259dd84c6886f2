"""Tokenizers: text <-> token ids, with an end-of-document id (eod)."""

from __future__ import annotations

import os
from typing import Iterable, SupportsInt

TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer")


class Tokenizer:
    """Interface the data tools and the trainer rely on."""

    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; its eos piece marks the end of a document."""

    def __init__(self, model_path: str):
        import sentencepiece as spm  # imported here so NullTokenizer users do not need it

        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"--tokenizer-model: file not found: {model_path}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"--tokenizer-model: {model_path} is not a readable "
                             f"SentencePiece model ({e})") from None
        self.model_path = model_path
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"--tokenizer-model: {model_path} has no eos piece to use as "
                             f"the end-of-document token")

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        # SentencePiece wants plain ints, not numpy or torch scalars.
        return self._sp.decode([int(i) for i in ids])


class NullTokenizer(Tokenizer):
    """Text is already token ids separated by whitespace (as in Megatron).

    The id ``vocab_size`` is added on top of the given vocabulary as eod.
    """

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(f"--vocab-size: must be a positive integer for NullTokenizer, "
                             f"got {vocab_size}")
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def tokenize(self, text: str) -> list[int]:
        return list(map(int, text.split()))

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        return " ".join(map(str, ids))


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None,
                    vocab_size: int | None = None) -> Tokenizer:
    """Build a tokenizer from the command-line flags.

    Flags a type does not use are ignored (the trainer passes its defaults along).
    """
    if tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-model: required for SentencePieceTokenizer")
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--vocab-size: required for NullTokenizer")
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type: unknown {tokenizer_type!r}; "
                     f"choose one of {', '.join(TOKENIZER_TYPES)}")
