"""From flags to tokenizer and train/valid/test datasets, with every file check in one place."""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import TYPE_CHECKING, BinaryIO, Optional, TypeGuard

from megaulysses.config import Config, ConfigError
from megaulysses.config.fields import filled
from megaulysses.data.gpt_dataset import (MockGPTDataset, atomic_write,
                                          build_train_valid_test_datasets, parse_data_path,
                                          parse_split)
from megaulysses.data.indexed import (HEADER_SIZE, IndexedDataset, IndexedDatasetError,
                                      dataset_exists)
from megaulysses.data.tokenizer import Tokenizer, build_tokenizer

if TYPE_CHECKING:
    from megaulysses.data.gpt_dataset import BlendedDataset, GPTDataset

log = logging.getLogger(__name__)


def load_tokenizer(cfg: Config) -> Tokenizer:
    d = cfg.data
    for flag, path in _tokenizer_paths(cfg):
        if path is None or not os.path.isfile(path):
            raise ConfigError(flag, f"file not found: {path}")
        if not os.access(path, os.R_OK):
            raise ConfigError(flag, f"{path}: cannot read (permission denied)")
    try:
        return build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_size,
                               d.vocab_file, d.merge_file, d.eod_token_id,
                               d.tokenizer_hf_include_special_tokens)
    except (OSError, ValueError, RuntimeError) as e:
        raise _load_error(cfg, str(e)) from None


def _load_error(cfg: Config, message: str) -> ConfigError:
    d = cfg.data
    if d.tokenizer_type == "GPT2BPETokenizer":  # its messages start with the flag, name the file
        flag, _, reason = message.partition(": ")
        if flag in ("--vocab-file", "--merge-file"):
            return ConfigError(flag, reason)
        return ConfigError("--vocab-file/--merge-file", message)
    if d.tokenizer_type == "HuggingFaceTokenizer":  # its messages name the flag and the file
        flag, _, reason = message.partition(": ")
        if flag in ("--tokenizer-model", "--eod-token-id"):
            return ConfigError(flag, reason)
        return ConfigError("--tokenizer-model", f"cannot load {d.tokenizer_model}: {message}")
    flag = "--vocab-size" if d.tokenizer_type == "NullTokenizer" else "--tokenizer-model"
    reason = message.removeprefix(f"{flag}:").strip()
    return ConfigError(flag, f"cannot load {d.tokenizer_model}: {reason}")


def _tokenizer_paths(cfg: Config) -> list[tuple[str, Optional[str]]]:
    """(flag, path) of each file the run's tokenizer is read from (None: not given)."""
    d = cfg.data
    if d.tokenizer_type == "GPT2BPETokenizer":
        return [("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)]
    if d.tokenizer_type == "SentencePieceTokenizer":
        return [("--tokenizer-model", d.tokenizer_model)]
    return []  # HuggingFaceTokenizer checks its own files (a directory's among them)


def sample_counts(cfg: Config) -> tuple[int, int, int]:
    """Samples each split must provide: all training steps, every evaluation, one test eval."""
    t = cfg.train
    # Megatron-LM's: --train-samples where given (whole batches of it are taken)
    gbs = filled(t.global_batch_size, "--global-batch-size")
    train = t.train_samples or filled(t.train_iters, "--train-iters") * gbs
    evals = (filled(t.train_iters, "--train-iters") // t.eval_interval
             if t.eval_interval else 0) + 1
    valid = evals * t.eval_iters * gbs
    test = t.eval_iters * gbs
    return train, valid, test


def build_datasets(cfg: Config, vocab_size: int
                   ) -> tuple[GPTDataset | BlendedDataset | MockGPTDataset | None, ...]:
    """(train, valid, test); valid/test may be None when their split is empty."""
    counts = sample_counts(cfg)
    seq, seed = cfg.model.seq_length, cfg.train.seed
    try:
        weights = parse_split(cfg.data.split)
    except ValueError as e:
        raise ConfigError("--split", str(e).removeprefix("--split:").strip()) from None
    if weights[0] == 0:
        raise ConfigError("--split", f"the train split must not be empty, got {cfg.data.split}")
    # A split given weight 0 (e.g. 98,2,0) is not evaluated; others must hold documents.
    n_train, n_valid, n_test = (n if w > 0 else 0
                                for n, w in zip(counts, weights, strict=True))
    counts = n_train, n_valid, n_test
    if cfg.data.mock_data:
        return tuple(MockGPTDataset(n, seq, vocab_size, seed + i) if n else None
                     for i, n in enumerate(counts))
    try:
        # the rules require --data-path without --mock-data
        prefixes, weights = parse_data_path(filled(cfg.data.data_path, "--data-path"))
    except ValueError as e:
        raise ConfigError("--data-path", str(e).removeprefix("--data-path:").strip()) from None
    prefixes = [_prefix_of(p) for p in prefixes]
    for prefix in prefixes:
        if not dataset_exists(prefix):
            raise ConfigError("--data-path", f"{prefix}.bin/.idx not found (give the "
                              "prefix, without .bin or .idx)")
    cache = cfg.data.data_cache_path or prefixes[0] + "_cache"
    try:
        for prefix in prefixes:
            _check_tokens(prefix, vocab_size, cache, _vocabulary_flag(cfg))
        return build_train_valid_test_datasets(prefixes, weights, cfg.data.split, counts,
                                               seq, seed, cache)
    except IndexedDatasetError as e:
        raise ConfigError("--data-path", str(e)) from None
    except OSError as e:  # e.g. no read permission: one line naming the file
        raise ConfigError("--data-path", f"{e.filename}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        msg = str(e)
        flag = msg.split(":")[0] if msg.startswith("--") else "--data-path"
        raise ConfigError(flag, msg.removeprefix(flag + ":").strip()) from None


def _prefix_of(path: str) -> str:
    """Megatron's --data-path is a prefix; a path to its .bin or .idx means the same one."""
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix) and dataset_exists(path[:-len(suffix)]):
            return path[:-len(suffix)]
    return path


def _vocabulary_flag(cfg: Config) -> str:
    """The flag that sets the vocabulary, for an error about token ids."""
    if cfg.data.tokenizer_type == "GPT2BPETokenizer":
        return "--vocab-file"
    return "--tokenizer-model/--vocab-size"


def _check_tokens(prefix: str, vocab_size: int, cache_dir: str, flag: str) -> None:
    """Every token id in the data must be in [0, the tokenizer's vocabulary size)."""
    low, high = _token_range(prefix, cache_dir)
    if low < 0:
        # Garbage bytes in the .bin, or a dtype code turned from unsigned to signed.
        raise ConfigError("--data-path", f"{prefix}.bin holds token id {low}: token ids must "
                          f"be >= 0 (damaged .bin, or a wrong dtype code in {prefix}.idx)")
    if high >= vocab_size:
        raise ConfigError(flag,
                          f"{prefix}.bin holds token id {high} but the vocabulary has "
                          f"{vocab_size} entries: use the tokenizer the data was made with")


# Cached (smallest, largest) token id of each data prefix, in the --data-cache-path.
TOKEN_RANGES = "token_ranges.json"


def _token_range(prefix: str, cache_dir: str) -> tuple[int, int]:
    """Scanning a large .bin takes a while, so the result is cached together with the
    identity of the files it was read from; changed files are scanned again."""
    path = os.path.join(cache_dir, TOKEN_RANGES)
    key, identity = os.path.abspath(prefix), _identity(prefix)
    ranges = _read_token_ranges(path)
    entry = ranges.get(key)
    if _valid_entry(entry) and entry["identity"] == identity:
        return tuple(entry["range"])
    if entry is not None:
        why = "was read from other data" if _valid_entry(entry) else "is malformed"
        log.warning("%s: the entry for %s %s; rescanning %s.bin", path, key, why, prefix)
    ranges[key] = {"identity": identity, "range": list(IndexedDataset(prefix).token_range())}
    try:
        os.makedirs(cache_dir, exist_ok=True)
        atomic_write(path, functools.partial(_write_json, ranges))
    except OSError:
        log.warning("cannot write %s (read-only data dir?); rescanning next time", path)
    return tuple(ranges[key]["range"])


def _identity(prefix: str) -> str:
    """Changes whenever either file is rewritten or replaced (the inode and ctime change
    even when a copy keeps the old mtime, as cp -p does), and with the .idx header: its
    dtype code sets how the .bin reads, and a change to it alters no size."""
    parts = []
    for path in (prefix + ".idx", prefix + ".bin"):
        st = os.stat(path)
        parts.append(f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}")
    with open(prefix + ".idx", "rb") as f:
        parts.append(f.read(HEADER_SIZE).hex())
    return "|".join(parts)


def _read_token_ranges(path: str) -> dict:
    """The cache's entries; {} when there is none, or (after a warning) when it is damaged."""
    try:
        with open(path, "rb") as f:
            ranges = json.loads(f.read())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s); rebuilding it", path, e)
        return {}
    if not isinstance(ranges, dict):
        log.warning("%s: not a token range cache (a JSON %s); rebuilding it", path,
                    type(ranges).__name__)
        return {}
    return ranges


def _write_json(value: object, f: BinaryIO) -> None:
    f.write(json.dumps(value).encode())


def _valid_entry(entry: object) -> TypeGuard[dict]:
    return (isinstance(entry, dict) and isinstance(entry.get("identity"), str)
            and isinstance(entry.get("range"), list) and len(entry["range"]) == 2
            and all(type(v) is int for v in entry["range"]))
