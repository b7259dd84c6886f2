"""GPT training samples from indexed datasets, in the manner of Megatron's GPTDataset.

A split's documents are shuffled and repeated for as many epochs as needed,
then read as one token stream.  Sample i is tokens
[i * seq_length, i * seq_length + seq_length + 1) of that stream (inputs and
shifted labels share the middle tokens), and samples are served in a
shuffled order.  The three index arrays behind this are built with numpy and
cached as .npy files, keyed by a hash of everything they depend on; a cache file
that is damaged or was made for other settings is rebuilt, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import uuid
from typing import BinaryIO, Callable

import numpy as np

from megaulysses.data.indexed import IndexedDataset

log = logging.getLogger(__name__)

# Bump when the index construction changes so stale caches are not reused.
_INDEX_FORMAT = "megaulysses-gpt-index-v1"
_SPLIT_NAMES = ("train", "valid", "test")


# ---------------------------------------------------------------- splits


def parse_split(split: str) -> list[float]:
    """"969,30,1" -> normalised [train, valid, test] weights ("1" -> all train)."""
    rule = ("--split: expected up to 3 comma-separated non-negative numbers with a "
            f"positive sum, e.g. 969,30,1; got {split!r}")
    # "'99,1,0'": a script's shell quoting that reached us whole (Megatron-LM accepts it)
    parts = split.strip().strip("'\"").replace("/", ",").split(",")
    if not 1 <= len(parts) <= 3:
        raise ValueError(rule)
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(rule) from None
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(rule)
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_boundaries(num_documents: int, weights: list[float]) -> list[int]:
    """[0, b1, b2, num_documents]: split k holds documents [b_k, b_k+1).

    Rounding the cumulative fractions (not each share) keeps the boundaries
    ordered and makes the ranges cover every document exactly once.
    """
    cumulative = np.cumsum([0.0] + list(weights))
    bounds = [int(round(c * num_documents)) for c in cumulative]
    bounds[-1] = num_documents
    return [min(b, num_documents) for b in bounds]


# ---------------------------------------------------------------- caching

# Each cache file is an .npy followed by a trailer: this magic, the sha256 of the
# description the arrays were built for, and the sha256 of the .npy bytes before it.
# np.load ignores the trailer; it lets a load tell a file made for other settings or
# data, or damaged on disk (truncated, garbage bytes), from a good one.
_TRAILER_MAGIC = b"MUIDXSUM"
_TRAILER = struct.Struct("<8s32s32s")


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    """write(f) to a private temporary file, then rename it to path: readers (other ranks,
    later runs) see no file or the whole file, never a half-written one."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # unique across ranks and hosts
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _sha256(path: str, n_bytes: int) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while n_bytes > 0 and (block := f.read(min(n_bytes, 1 << 24))):
            digest.update(block)
            n_bytes -= len(block)
    return digest.digest()


def _write_cache_file(path: str, array: np.ndarray, made_for: bytes) -> None:
    def write(f):
        np.save(f, array, allow_pickle=False)
        f.flush()
        f.write(_TRAILER.pack(_TRAILER_MAGIC, made_for, _sha256(f.name, f.tell())))
    atomic_write(path, write)


def _cache_file_problem(path: str, made_for: bytes) -> str | None:
    """Why the cache file cannot be used, or None when it is intact and made for us."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(size - _TRAILER.size, 0))
        trailer = f.read()
    if len(trailer) != _TRAILER.size or not trailer.startswith(_TRAILER_MAGIC):
        return "no checksum trailer (truncated, or written by an older version)"
    _, saved_for, checksum = _TRAILER.unpack(trailer)
    if saved_for != made_for:
        return "made for other settings or data"
    if _sha256(path, size - _TRAILER.size) != checksum:
        return "checksum mismatch (damaged on disk)"
    return None


def _load_cached(paths: dict, made_for: bytes) -> dict | None:
    """The cached arrays, or None (after a warning naming the file) when any is unusable."""
    if not any(os.path.exists(p) for p in paths.values()):
        return None  # never built: nothing to warn about
    arrays = {}
    for kind, path in paths.items():
        try:
            problem = (_cache_file_problem(path, made_for) if os.path.exists(path) else
                       "missing (a run stopped while writing the cache?)")
            if problem is None:
                arrays[kind] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            problem = f"unreadable ({e})"
        if problem is not None:
            log.warning("dataset cache %s: %s; rebuilding it", path, problem)
            return None
    return arrays


def _load_or_build(cache_dir, name: str, description: str, kinds: list[str], build):
    """Arrays from the cache when all are there and intact, else build() them (and cache them).

    Files are named <name>_<hash of description>_<kind>.npy and checked against their
    trailer before use.  Returns (arrays, loaded_from_cache).  Each file is written under
    a private temporary name and renamed, so ranks building at once never read a partial
    file, and a crash never leaves one that a later run trusts.
    """
    if cache_dir is None:
        return build(), False
    made_for = hashlib.sha256(description.encode()).digest()
    paths = {k: os.path.join(cache_dir, f"{name}_{made_for.hex()[:16]}_{k}.npy") for k in kinds}
    arrays = _load_cached(paths, made_for)
    if arrays is not None:
        return arrays, True
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for kind, path in paths.items():
            _write_cache_file(path, arrays[kind], made_for)
    except OSError as e:  # e.g. a read-only data directory: train anyway
        log.warning("cannot cache dataset indices in %s: %s", cache_dir, e)
    return arrays, False


# ---------------------------------------------------------------- GPT dataset


def _build_document_index(document_ids: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    """The split's documents, each epoch shuffled on its own, epochs back to back."""
    rng = np.random.RandomState(seed)
    epochs = []
    for _ in range(num_epochs):
        epoch = document_ids.copy()
        rng.shuffle(epoch)
        epochs.append(epoch)
    return np.concatenate(epochs) if epochs else document_ids[:0].copy()


def _build_sample_index(doc_lengths: np.ndarray, num_samples: int, seq_length: int) -> np.ndarray:
    """(num_samples + 1, 2): [position in document index, offset] of token i * seq_length.

    Sample i runs from row i to row i + 1 inclusive of that last token.
    """
    starts = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, dtype=np.int64, out=starts[1:])
    targets = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: it picks the last document starting
    # at or before the target, which is the one that contains it.
    positions = np.searchsorted(starts, targets, side="right") - 1
    return np.stack([positions, targets - starts[positions]], axis=1)


class GPTDataset:
    """num_samples samples of seq_length + 1 tokens from the given documents."""

    def __init__(self, indexed: IndexedDataset, document_ids: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, cache_dir: str | None, name: str):
        if seq_length < 1 or num_samples < 0:
            raise ValueError(f"{name}: need seq_length >= 1 and num_samples >= 0")
        self.indexed = indexed
        self.name = name
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        lengths = np.ascontiguousarray(indexed.sequence_lengths[self.document_ids])
        tokens_per_epoch = int(lengths.sum(dtype=np.int64))
        if num_samples > 0 and tokens_per_epoch == 0:
            raise ValueError(f"{name} split: has {len(self.document_ids)} documents and no "
                             f"tokens, but {num_samples} samples were requested (see --split)")
        # The last sample needs token num_samples * seq_length, hence + 1.
        tokens_needed = num_samples * seq_length + 1 if num_samples else 0
        self.num_epochs = -(-tokens_needed // tokens_per_epoch) if tokens_needed else 0
        self.description = "\n".join([
            _INDEX_FORMAT, f"class: {type(self).__name__}", f"name: {name}",
            f"prefix: {os.path.abspath(indexed.prefix)}",
            f"dataset: {len(indexed)} sequences, {indexed.num_tokens} tokens",
            # The indices depend on exactly these documents and their lengths.
            f"documents: {len(self.document_ids)} "
            f"sha256 {hashlib.sha256(self.document_ids.tobytes()).hexdigest()}",
            f"lengths: sha256 {hashlib.sha256(lengths.tobytes()).hexdigest()}",
            f"num_samples: {num_samples}", f"seq_length: {seq_length}", f"seed: {seed}"])
        arrays, self.loaded_from_cache = _load_or_build(
            cache_dir, name, self.description,
            ["document_index", "sample_index", "shuffle_index"],
            lambda: self._build_indices(seed))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _build_indices(self, seed: int) -> dict:
        document_index = _build_document_index(self.document_ids, self.num_epochs, seed)
        lengths = self.indexed.sequence_lengths[document_index]
        sample_index = _build_sample_index(lengths, self.num_samples, self.seq_length)
        shuffle_index = np.random.RandomState(seed + 1).permutation(self.num_samples)
        return {"document_index": document_index, "sample_index": sample_index,
                "shuffle_index": shuffle_index.astype(np.int64)}

    def __len__(self) -> int:
        return self.num_samples

    def unshuffled(self, i: int) -> np.ndarray:
        """Sample i of the token stream, before the sample shuffle."""
        (first, start), (last, end) = self.sample_index[i], self.sample_index[i + 1]
        get = self.indexed.get
        if first == last:
            parts = [get(self.document_index[first], start, end - start + 1)]
        else:
            parts = [get(self.document_index[first], start)]
            parts += [get(self.document_index[d]) for d in range(first + 1, last)]
            parts.append(get(self.document_index[last], 0, end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name}: sample {i} out of range (0..{self.num_samples - 1})")
        return self.unshuffled(int(self.shuffle_index[i]))


# ---------------------------------------------------------------- blending


def _build_blending_indices(weights: list[float], num_samples: int) -> dict:
    """Greedy interleaving: each step serves the dataset furthest behind its share."""
    counts = [0] * len(weights)
    dataset_index = np.empty(num_samples, dtype=np.int16)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    # A plain Python loop over a handful of datasets beats numpy's per-call
    # overhead here; the result is cached.
    for i in range(num_samples):
        errors = [w * (i + 1) - c for w, c in zip(weights, counts, strict=True)]
        best = errors.index(max(errors))  # ties -> lowest index
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}


class BlendedDataset:
    """Samples drawn from several datasets in proportion to their weights."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int, seed: int,
                 cache_dir: str | None, name: str):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{name}: need one weight per dataset")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError(f"{name}: too many datasets to blend ({len(datasets)})")
        total = float(sum(weights))
        if total <= 0 or min(weights) < 0:
            raise ValueError(f"{name}: blend weights must be non-negative with a positive sum")
        self.datasets = datasets
        self.weights = [w / total for w in weights]
        self.num_samples = num_samples
        self.name = name
        members = "\n".join(getattr(d, "description", repr(d)) for d in datasets)
        self.description = "\n".join([
            _INDEX_FORMAT, f"class: {type(self).__name__}", f"name: {name}",
            f"weights: {self.weights!r}", f"num_samples: {num_samples}", f"seed: {seed}",
            "members:", members])
        arrays, self.loaded_from_cache = _load_or_build(
            cache_dir, name, self.description, ["dataset_index", "dataset_sample_index"],
            lambda: _build_blending_indices(self.weights, num_samples))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self._check_sizes()

    def _check_sizes(self) -> None:
        for k, dataset in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == k]
            needed = int(used.max()) + 1 if used.size else 0
            if needed > len(dataset):
                raise ValueError(f"{self.name}: blend needs {needed} samples from dataset {k} "
                                 f"but it has {len(dataset)}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name}: sample {i} out of range (0..{self.num_samples - 1})")
        dataset = self.datasets[int(self.dataset_index[i])]
        return dataset[int(self.dataset_sample_index[i])]


# ---------------------------------------------------------------- mock data


class MockGPTDataset:
    """Random tokens for --mock-data; sample i depends only on (seed, i)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock: sample {i} out of range (0..{self.num_samples - 1})")
        rng = np.random.default_rng([self.seed, i])
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)


# ---------------------------------------------------------------- --data-path


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


_PAIRS = "weight-prefix pairs like '0.3 A 0.7 B'"


def _weight(text: str, prefix: str) -> float:
    """A blend weight: a positive, finite number (Megatron normalises them to sum to 1)."""
    value = _as_number(text)
    if value is None:
        problem = "is not a number"
    elif not math.isfinite(value):
        problem = "is not a finite number"
    elif value < 0:
        problem = "is negative"
    elif value == 0:
        problem = "is zero"
    else:
        return value
    raise ValueError(f"--data-path: weight {text!r} for {prefix} {problem}; blend weights "
                     f"must be positive numbers, as in {_PAIRS}")


def parse_data_path(args: list[str]) -> tuple[list[str], list[float]]:
    """Megatron's --data-path forms: "A", "A B C" (equal weights), "0.3 A 0.7 B"."""
    args = list(args)
    if not args:
        raise ValueError("--data-path: give one prefix, several prefixes (equal weights), "
                         f"or {_PAIRS}; got nothing")
    # A number where a weight goes means weight-prefix pairs; then every weight must be
    # one, so a typo like "abc A 1 B" or "nan A 1 B" is named rather than read as a prefix.
    if len(args) == 1 or all(_as_number(a) is None for a in args[0::2]):
        if len(args) > 1 and any(_as_number(a) is not None for a in args):
            raise ValueError(f"--data-path: got a mix of prefixes and numbers: "
                             f"{' '.join(args)} (give prefixes only, or {_PAIRS})")
        return args, [1.0] * len(args)
    if len(args) % 2:
        raise ValueError(f"--data-path: {len(args)} values ({' '.join(args)}), but "
                         f"{_PAIRS} need an even number")
    prefixes = args[1::2]
    return prefixes, [_weight(w, p) for w, p in zip(args[0::2], prefixes, strict=True)]


# ---------------------------------------------------------------- train/valid/test


def build_train_valid_test_datasets(prefixes: list[str], weights: list[float], split: str,
                                    num_samples: tuple[int, int, int], seq_length: int,
                                    seed: int, cache_dir: str | None) -> tuple:
    """(train, valid, test): None where no samples are asked for.

    One prefix gives GPTDatasets; several give a BlendedDataset per split whose
    member k is built with a little more than its share of samples.
    """
    fractions = parse_split(split)
    indexed = [IndexedDataset(p) for p in prefixes]
    bounds = [split_boundaries(len(d), fractions) for d in indexed]
    total = float(sum(weights))
    result: list[GPTDataset | BlendedDataset | None] = []
    for s, name in enumerate(_SPLIT_NAMES):
        n = num_samples[s]
        if n == 0:
            result.append(None)
            continue
        members = []
        for k, dataset in enumerate(indexed):
            first, stop = bounds[k][s], bounds[k][s + 1]
            if first == stop:
                raise ValueError(f"--split: {split!r} leaves the {name} split of {prefixes[k]} "
                                 f"empty ({len(dataset)} documents) but {n} {name} samples "
                                 f"are needed")
            member_samples = n if len(indexed) == 1 else \
                math.ceil(weights[k] / total * n * 1.005) + 1
            members.append(GPTDataset(dataset, np.arange(first, stop), member_samples,
                                      seq_length, seed, cache_dir,
                                      name if len(indexed) == 1 else f"{name}_part{k}"))
        if len(members) == 1:
            result.append(members[0])
        else:
            result.append(BlendedDataset(members, weights, n, seed, cache_dir, f"{name}_blend"))
    return tuple(result)
