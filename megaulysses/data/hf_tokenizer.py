"""Hugging Face tokenizers: a tokenizer.json (Llama 3's, Qwen's, Mistral's, GPT-2's, ...)
run by the `tokenizers` library, as Megatron-LM's HuggingFaceTokenizer runs it through
transformers. No transformers at run time and no network: the files are read as they are.

`--tokenizer-model` is a directory holding tokenizer.json (a model's directory from the
Hub, or a checkpoint's), or a tokenizer.json file. The end-of-document id is the
tokenizer's eos unless --eod-token-id says otherwise; the eos comes from the directory's
tokenizer_config.json ("eos_token", the token's text), else special_tokens_map.json, else
the "eos_token_id" of generation_config.json or config.json. A lone tokenizer.json names
no eos: give --eod-token-id then.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional, SupportsInt

from megaulysses.data.tokenizer_base import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# What a checkpoint stores beside its weights, by these names (those present).
HF_TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
# Files that name the special tokens by text ("eos_token"), then those that give ids
# ("eos_token_id"), in the order they are asked.
_TOKEN_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
_ID_FILES = ("generation_config.json", "config.json")


def tokenizer_json(path: str) -> str:
    """The tokenizer.json of --tokenizer-model (a directory, or the file itself)."""
    return os.path.join(path, TOKENIZER_JSON) if os.path.isdir(path) else path


def hf_tokenizer_files(path: str) -> dict[str, str]:
    """{name in a checkpoint: path} of the tokenizer files --tokenizer-model has (none
    where it has nothing, so that a plan made before the files are opened works)."""
    if os.path.isdir(path):
        found = {name: os.path.join(path, name) for name in HF_TOKENIZER_FILES}
        return {name: p for name, p in found.items() if os.path.isfile(p)}
    return {TOKENIZER_JSON: path} if os.path.isfile(path) else {}


class HuggingFaceTokenizer(Tokenizer):
    """`path`: --tokenizer-model; `eod_token_id`: --eod-token-id (None: the eos);
    `include_special_tokens`: the tokenizer's post-processor adds its special tokens
    (Llama 3's <|begin_of_text|>) to each text, as transformers' tokenizer(text) does. The
    flags' default, as Megatron-LM's (build_tokenizer); False here, for callers that want
    the text's ids alone; --tokenizer-hf-no-include-special-tokens.

    vocab_size: the largest id + 1, added tokens included (the embedding holds every id);
    eod, eos, bos: ids (eos and bos None where the files name none); files: the files a
    checkpoint stores, {name: path}. A special token written in text (e.g. "<|eot_id|>")
    is that token, as in transformers."""

    def __init__(self, path: str, eod_token_id: Optional[int] = None,
                 include_special_tokens: bool = False):
        from tokenizers import Tokenizer as _Tokenizer  # imported here: only this type needs it

        self.path, self.include_special_tokens = path, include_special_tokens
        self.json_path = tokenizer_json(path)
        text = _read_text(self.json_path, os.path.isdir(path), "a Hugging Face tokenizer.json")
        try:
            self._tok = _Tokenizer.from_str(text)
        except Exception as e:  # `tokenizers` raises a bare Exception for every parse error
            raise ValueError(f"--tokenizer-model: {self.json_path} is not a Hugging Face "
                             f"tokenizer.json ({_first_line(e)})") from None
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        if not self._vocab:
            raise ValueError(f"--tokenizer-model: {self.json_path} has an empty vocabulary")
        self.vocab_size = max(self._vocab.values()) + 1
        self.files = hf_tokenizer_files(path)
        configs = _configs(path) if os.path.isdir(path) else []
        self.eos, self.bos = (self._special(kind, configs) for kind in ("eos", "bos"))
        self.eod = self._eod(eod_token_id)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.include_special_tokens).ids

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        # Special tokens are written out: a sample shows where a document ended.
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def _eod(self, eod_token_id: Optional[int]) -> int:
        if eod_token_id is None:
            if self.eos is None:
                raise ValueError(f"--tokenizer-model: {self.path} names no eos token (no "
                                 f"{TOKENIZER_CONFIG} \"eos_token\"): give the "
                                 "end-of-document id with --eod-token-id")
            return self.eos
        if not 0 <= eod_token_id < self.vocab_size:
            raise ValueError(f"--eod-token-id: {eod_token_id} is outside the vocabulary of "
                             f"{self.json_path} [0, {self.vocab_size})")
        return eod_token_id

    def _special(self, kind: str, configs: list[tuple[str, dict]]) -> Optional[int]:
        """The id of the eos or bos token: the first file with the key decides, a null
        naming none (Qwen's "bos_token": null), as transformers reads them."""
        for name, config in configs:
            key = f"{kind}_token" if name in _TOKEN_FILES else f"{kind}_token_id"
            if key not in config:
                continue
            if config[key] is None:
                return None
            if name in _TOKEN_FILES:
                token = config[key]
                if isinstance(token, dict):  # {"content": "</s>", "lstrip": false, ...}
                    token = token.get("content")
                if not isinstance(token, str) or token not in self._vocab:
                    raise ValueError(f"--tokenizer-model: {os.path.join(self.path, name)}: "
                                     f"{kind}_token {token!r} is not in the vocabulary of "
                                     f"{self.json_path}")
                return self._vocab[token]
            ids = config[key]
            first = ids[0] if isinstance(ids, list) and ids else ids  # Llama 3.1: a list
            if type(first) is not int or not 0 <= first < self.vocab_size:
                raise ValueError(f"--tokenizer-model: {os.path.join(self.path, name)}: "
                                 f"{kind}_token_id {ids!r} is not an id of the vocabulary "
                                 f"of {self.json_path} [0, {self.vocab_size})")
            return first
        return None


def _read_text(path: str, inside: bool = False, what: str = "a JSON file") -> str:
    """A UTF-8 file's text; ValueError naming --tokenizer-model and the file otherwise.
    `inside`: the file was looked for in a directory --tokenizer-model names."""
    if not os.path.isfile(path):
        sentencepiece = os.path.join(os.path.dirname(path), "tokenizer.model")
        hint = (f" ({sentencepiece} is there: --tokenizer-type SentencePieceTokenizer reads "
                "it)" if inside and os.path.isfile(sentencepiece) else "")
        raise ValueError(f"--tokenizer-model: file not found: {path}{hint}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--tokenizer-model: {path} is not {what} (not UTF-8 text: "
                         f"{e.reason})") from None
    except OSError as e:
        raise ValueError(f"--tokenizer-model: {path}: cannot read "
                         f"({(e.strerror or str(e)).lower()})") from None


def _configs(directory: str) -> list[tuple[str, dict]]:
    """(name, contents) of the directory's files that may name eos and bos, in the order
    they are asked; a file present but not a JSON object is an error naming it."""
    found = []
    for name in (*_TOKEN_FILES, *_ID_FILES):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            config = json.loads(_read_text(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"--tokenizer-model: {path} is not JSON ({e.msg}, line "
                             f"{e.lineno})") from None
        if not isinstance(config, dict):
            raise ValueError(f"--tokenizer-model: {path} is not a JSON object")
        found.append((name, config))
    return found


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
