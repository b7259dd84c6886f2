"""Tokenizers: text <-> token ids, with an end-of-document id (eod)."""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional, SupportsInt

from megaulysses.data.tokenizer_base import Tokenizer  # the interface, here as before

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer")
# GPT-2's end-of-text token: Megatron-LM's GPT2BPETokenizer ends documents with it.
GPT2_EOD = "<|endoftext|>"


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


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from its vocab.json and merges.txt (Megatron-LM's
    GPT2BPETokenizer): the ids of OpenAI's GPT-2 encoder, run by the `tokenizers` library.

    As in Megatron-LM, the vocabulary size is the number of entries in vocab.json, the
    end-of-document id is that of <|endoftext|>, and no token is special: the text
    "<|endoftext|>" in a document is tokenized as the characters it is.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer as _Tokenizer  # imported here: only this type needs it
        from tokenizers import decoders, models, pre_tokenizers

        vocab = _read_gpt2_vocab(vocab_file)
        merges = _read_gpt2_merges(merge_file, vocab)
        self._tok = _Tokenizer(models.BPE(vocab=vocab, merges=merges))
        # GPT-2's pre-tokenizing regex on the UTF-8 bytes mapped to printable characters;
        # no space is put before the text (GPT-2 encodes "Hello" and " Hello" apart).
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.vocab_size = len(vocab)
        self.eod = vocab[GPT2_EOD]

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        # Bytes that end mid-character decode to U+FFFD, as GPT-2's errors="replace".
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _read_gpt2_vocab(path: str) -> dict[str, int]:
    """vocab.json: every token to its id, the ids 0..n-1, all 256 byte symbols and
    <|endoftext|> among the tokens (ValueError naming --vocab-file otherwise)."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--vocab-file: {path} is not a GPT-2 vocab.json ({e})") from None
    if not isinstance(vocab, dict) or not all(type(i) is int for i in vocab.values()):
        raise ValueError(f"--vocab-file: {path} is not a GPT-2 vocab.json (a JSON object "
                         "of token -> integer id)")
    if sorted(vocab.values()) != list(range(len(vocab))):
        # The embedding has one row per entry: an id past the count would fall outside it.
        raise ValueError(f"--vocab-file: {path}: the ids must be 0..{len(vocab) - 1}, each "
                         "once")
    from tokenizers import pre_tokenizers
    # The 256 characters GPT-2 writes the bytes of text as.
    missing = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab]
    if missing:
        raise ValueError(f"--vocab-file: {path} is not a byte-level vocabulary: "
                         f"{len(missing)} of the 256 byte symbols are missing")
    if GPT2_EOD not in vocab:
        raise ValueError(f"--vocab-file: {path} has no {GPT2_EOD} token (the "
                         "end-of-document id)")
    return vocab


def _read_gpt2_merges(path: str, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """merges.txt: a "#version" header line, then one "left right" pair a line, by rank;
    both tokens and the token they make must be in `vocab`."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"--merge-file: {path} is not UTF-8 text ({e.reason})") from None
    # GPT-2 and Megatron-LM drop the first line unread: it must be the header, or a merge
    # would be lost without a word.
    if not lines[0].startswith("#version"):
        raise ValueError(f"--merge-file: {path} does not start with GPT-2's \"#version\" "
                         "header line")
    merges = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        pair = line.split()
        if len(pair) != 2:
            raise ValueError(f"--merge-file: {path}:{number}: expected two tokens, got "
                             f"{line!r}")
        # (`tokenizers` would abort the process on a merge outside the vocabulary.)
        unknown = [t for t in (*pair, "".join(pair)) if t not in vocab]
        if unknown:
            raise ValueError(f"--merge-file: {path}:{number}: {unknown[0]!r} is not in the "
                             "--vocab-file (the two files do not belong together)")
        merges.append((pair[0], pair[1]))
    return merges


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
                    vocab_size: int | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, eod_token_id: int | None = None,
                    include_special_tokens: Optional[bool] = None) -> Tokenizer:
    """Build a tokenizer from the command-line flags.

    Flags a type does not use are ignored (the trainer passes its defaults along), except
    HuggingFaceTokenizer's own: `eod_token_id` (--eod-token-id) and `include_special_tokens`
    (--tokenizer-hf-[no-]include-special-tokens; None: not given, Megatron-LM's default of
    including them) given to another type are an error.
    """
    if tokenizer_type == "HuggingFaceTokenizer":
        from megaulysses.data.hf_tokenizer import HuggingFaceTokenizer  # needs `tokenizers`
        if not tokenizer_model:
            raise ValueError("--tokenizer-model: required for HuggingFaceTokenizer")
        return HuggingFaceTokenizer(tokenizer_model, eod_token_id,
                                    include_special_tokens is not False)
    special = "--tokenizer-hf-" + ("" if include_special_tokens else "no-") + \
        "include-special-tokens"
    for flag, given in (("--eod-token-id", eod_token_id is not None),
                        (special, include_special_tokens is not None)):
        if given:  # another type would ignore it: a run that silently means something else
            raise ValueError(f"{flag}: is only used with --tokenizer-type HuggingFaceTokenizer")
    if tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-model: required for SentencePieceTokenizer")
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_gpt2_file("--vocab-file", vocab_file),
                                _gpt2_file("--merge-file", merge_file))
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--vocab-size: required for NullTokenizer")
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type: unknown {tokenizer_type!r}; "
                     f"choose one of {', '.join(TOKENIZER_TYPES)}")


def _gpt2_file(flag: str, path: Optional[str]) -> str:
    """A GPT2BPETokenizer file flag's path, given and present (else one line naming it)."""
    if not path:
        raise ValueError(f"{flag}: required for GPT2BPETokenizer")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: file not found: {path}")
    return path
