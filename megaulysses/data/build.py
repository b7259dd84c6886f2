"""From flags to tokenizer and train/valid/test datasets, with every file check in one place."""

from __future__ import annotations

import json
import logging
import os

from megaulysses.config import Config, ConfigError
from megaulysses.data.gpt_dataset import (MockGPTDataset, build_train_valid_test_datasets,
                                          parse_data_path, parse_split)
from megaulysses.data.indexed import IndexedDataset, IndexedDatasetError, dataset_exists
from megaulysses.data.tokenizer import Tokenizer, build_tokenizer

log = logging.getLogger(__name__)


def load_tokenizer(cfg: Config) -> Tokenizer:
    d = cfg.data
    if d.tokenizer_type == "SentencePieceTokenizer" and not os.path.isfile(d.tokenizer_model or ""):
        raise ConfigError("--tokenizer-model", f"file not found: {d.tokenizer_model}")
    try:
        return build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_size)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError("--tokenizer-model", f"cannot load {d.tokenizer_model}: {e}")


def sample_counts(cfg: Config) -> tuple[int, int, int]:
    """Samples each split must provide: all training steps, every evaluation, one test eval."""
    t = cfg.train
    train = t.train_iters * t.global_batch_size
    evals = t.train_iters // t.eval_interval + 1
    valid = evals * t.eval_iters * t.global_batch_size
    test = t.eval_iters * t.global_batch_size
    return train, valid, test


def build_datasets(cfg: Config, vocab_size: int):
    """(train, valid, test); valid/test may be None when their split is empty."""
    counts = sample_counts(cfg)
    seq, seed = cfg.model.seq_length, cfg.train.seed
    try:
        weights = parse_split(cfg.data.split)
    except ValueError as e:
        raise ConfigError("--split", str(e).removeprefix("--split:").strip())
    if weights[0] == 0:
        raise ConfigError("--split", f"the train split must not be empty, got {cfg.data.split}")
    # A split given weight 0 (e.g. 98,2,0) is not evaluated; others must hold documents.
    counts = tuple(n if w > 0 else 0 for n, w in zip(counts, weights))
    if cfg.data.mock_data:
        return tuple(MockGPTDataset(n, seq, vocab_size, seed + i) if n else None
                     for i, n in enumerate(counts))
    try:
        prefixes, weights = parse_data_path(cfg.data.data_path)
    except ValueError as e:
        raise ConfigError("--data-path", str(e).removeprefix("--data-path:").strip())
    prefixes = [_prefix_of(p) for p in prefixes]
    for prefix in prefixes:
        if not dataset_exists(prefix):
            raise ConfigError("--data-path", f"{prefix}.bin/.idx not found (give the "
                              "prefix, without .bin or .idx)")
    cache = cfg.data.data_cache_path or prefixes[0] + "_cache"
    try:
        for prefix in prefixes:
            _check_vocab(prefix, vocab_size, cache)
        return build_train_valid_test_datasets(prefixes, weights, cfg.data.split, counts,
                                               seq, seed, cache)
    except IndexedDatasetError as e:
        raise ConfigError("--data-path", str(e))
    except ValueError as e:
        msg = str(e)
        flag = msg.split(":")[0] if msg.startswith("--") else "--data-path"
        raise ConfigError(flag, msg.removeprefix(flag + ":").strip())


def _prefix_of(path: str) -> str:
    """Megatron's --data-path is a prefix; a path to its .bin or .idx means the same one."""
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix) and dataset_exists(path[:-len(suffix)]):
            return path[:-len(suffix)]
    return path


def _check_vocab(prefix: str, vocab_size: int, cache_dir: str):
    """Every token id in the data must be < the tokenizer's vocabulary size."""
    top = _max_token(prefix, cache_dir)
    if top >= vocab_size:
        raise ConfigError("--tokenizer-model/--vocab-size",
                          f"{prefix}.bin holds token id {top} but the vocabulary has "
                          f"{vocab_size} entries: use the tokenizer the data was made with")


def _max_token(prefix: str, cache_dir: str) -> int:
    """Scanning a large .bin takes a while, so the result is cached by file identity."""
    st = os.stat(prefix + ".bin")
    key = f"{os.path.abspath(prefix)}|{st.st_size}|{st.st_mtime_ns}"
    path = os.path.join(cache_dir, "max_token.json")
    cached = {}
    try:
        with open(path) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        pass
    if key not in cached:
        cached[key] = int(IndexedDataset(prefix).max_token())
        try:
            os.makedirs(cache_dir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(cached, f)
            os.replace(path + ".tmp", path)
        except OSError:
            log.warning("cannot write %s (read-only data dir?); rescanning next time", path)
    return cached[key]
