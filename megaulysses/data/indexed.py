"""Megatron's memory-mapped indexed dataset format (MMIDIDX), read and written.

A dataset is two files sharing a prefix:

``<prefix>.idx`` (little-endian)::

    magic            b"MMIDIDX\\x00\\x00"   9 bytes
    version          <Q                    always 1
    dtype code       <B                    see DTYPE_CODES
    sequence count   <Q                    S
    document count   <Q                    D (= number of documents + 1)
    sequence lengths int32[S]              tokens per sequence
    sequence ptrs    int64[S]              byte offset of each sequence in .bin
    document indices int64[D]              0, ..., S: first sequence of each document

``<prefix>.bin``: the tokens of all sequences back to back, in the dtype.

The layout matches Megatron-LM byte for byte, so files move freely between the
two frameworks.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING, NoReturn

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
# magic, version, dtype code, sequence count, document count
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34 bytes

# Megatron's codes; the numbers are part of the file format.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}

# Elements scanned at a time by max_token: bounds memory on huge .bin files.
_SCAN_CHUNK = 1 << 24


class IndexedDatasetError(ValueError):
    """A dataset file is missing, truncated or malformed; the message names the file."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype Megatron would pick for this vocabulary."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _code_of(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, known in DTYPE_CODES.items():
        if known == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no MMIDIDX code; use one of "
                     f"{sorted(str(d) for d in DTYPE_CODES.values())}")


def _paths(prefix: str) -> tuple[str, str]:
    return prefix + ".idx", prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    idx_path, bin_path = _paths(prefix)
    return os.path.isfile(idx_path) and os.path.isfile(bin_path)


def _write_index(path: str, dtype, lengths, document_indices) -> None:
    lengths = np.asarray(lengths, dtype=np.int32)
    document_indices = np.asarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    # pointer[i] = bytes taken by all sequences before i
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, _VERSION, _code_of(dtype), len(lengths),
                             len(document_indices)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(document_indices.astype("<i8").tobytes())


class IndexedDatasetWriter:
    """Writes a dataset; nothing appears under the final names until finalize().

    Tokens stream into ``<prefix>.bin.tmp<pid>``; finalize() writes the index to a
    temporary file too and then renames both, so a crash never leaves a
    half-written dataset that looks complete.  As a context manager it finalizes
    on success and discards the temporary files on error.
    """

    def __init__(self, prefix: str, dtype: npt.DTypeLike = np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        _code_of(self.dtype)  # fail early on a dtype the format cannot store
        suffix = f".tmp{os.getpid()}"
        self._idx_path, self._bin_path = _paths(prefix)
        self._idx_tmp = self._idx_path + suffix
        self._bin_tmp = self._bin_path + suffix
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._document_indices: list[int] = [0]
        self._finished = False

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError(f"{self.prefix}: writer already finalized or discarded")

    def _as_tokens(self, tokens: npt.ArrayLike) -> np.ndarray:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"{self.prefix}: a sequence must be 1-D, got shape {array.shape}")
        # Refuse values the dtype cannot hold instead of silently wrapping them.
        if array.size and self.dtype.kind in "iu" and array.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                raise ValueError(f"{self.prefix}: token {low if low < info.min else high} "
                                 f"does not fit in {self.dtype}")
        return array.astype(self.dtype, copy=False)

    def add_item(self, tokens: npt.ArrayLike) -> None:
        """Append one sequence."""
        self._check_open()
        array = self._as_tokens(tokens)
        self._bin.write(array.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._lengths.append(len(array))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call."""
        self._check_open()
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens: npt.ArrayLike) -> None:
        self.add_item(tokens)
        self.end_document()

    def merge(self, other_prefix: str) -> None:
        """Append a finished dataset (same dtype), e.g. one written by a worker."""
        self._check_open()
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{other_prefix}: dtype {other.dtype} differs from "
                             f"{self.prefix}'s {self.dtype}")
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._document_indices.extend((other.document_indices[1:] + offset).tolist())
        with open(other_prefix + ".bin", "rb") as f:
            while block := f.read(1 << 24):
                self._bin.write(block)

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        self._check_open()
        self._bin.close()
        _write_index(self._idx_tmp, self.dtype, self._lengths, self._document_indices)
        # .bin first: a crash in between leaves a .bin that no .idx describes,
        # which IndexedDataset rejects rather than reads wrongly.
        os.replace(self._bin_tmp, self._bin_path)
        os.replace(self._idx_tmp, self._idx_path)
        self._finished = True

    def discard(self) -> None:
        """Drop everything written so far (temporary files only)."""
        if self._finished:
            return
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        self._finished = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.discard()
        return False


class IndexedDataset:
    """Read-only view of a dataset; the tokens stay on disk (numpy memmap)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.idx_path, self.bin_path = _paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: file not found")
        try:
            self._read_index()
            self._check_pointers()
            self._open_bin()
        except OSError as e:  # e.g. no read permission: one line naming the file, no traceback
            raise IndexedDatasetError(f"{e.filename or prefix}: cannot read "
                                      f"({e.strerror or e})") from None

    def _fail(self, path: str, what: str) -> NoReturn:
        raise IndexedDatasetError(f"{path}: {what}")

    def _read_index(self) -> None:
        path = self.idx_path
        size = os.path.getsize(path)
        if size < _HEADER.size:
            self._fail(path, f"truncated: header needs {_HEADER.size} bytes, found {size}")
        with open(path, "rb") as f:
            magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC:
            self._fail(path, f"bad magic {magic!r}: not an MMIDIDX index file")
        if version != _VERSION:
            self._fail(path, f"unsupported version {version} (expected {_VERSION})")
        if code not in DTYPE_CODES:
            self._fail(path, f"unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = DTYPE_CODES[code]
        expected = _HEADER.size + 12 * n_seq + 8 * n_doc
        if size != expected:
            what = "truncated" if size < expected else "trailing bytes"
            self._fail(path, f"{what}: expected {expected} bytes for {n_seq} sequences and "
                             f"{n_doc} document entries, found {size}")
        index = np.memmap(path, mode="r", dtype=np.uint8)
        start = _HEADER.size
        self.sequence_lengths = np.frombuffer(index, "<i4", n_seq, start)
        start += 4 * n_seq
        self.sequence_pointers = np.frombuffer(index, "<i8", n_seq, start)
        start += 8 * n_seq
        self.document_indices = np.frombuffer(index, "<i8", n_doc, start)

    def _check_pointers(self) -> None:
        path, lengths, docs = self.idx_path, self.sequence_lengths, self.document_indices
        if lengths.size and lengths.min() < 0:
            self._fail(path, "negative sequence length")
        expected = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
        if not np.array_equal(expected * self.dtype.itemsize, self.sequence_pointers):
            self._fail(path, "sequence pointers do not match the sequence lengths")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
            self._fail(path, f"document indices must rise from 0 to the sequence count "
                             f"{len(lengths)}")

    def _open_bin(self) -> None:
        n_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        expected = n_tokens * self.dtype.itemsize
        found = os.path.getsize(self.bin_path)
        if found != expected:
            what = "truncated" if found < expected else "trailing bytes"
            self._fail(self.bin_path, f"{what}: expected {expected} bytes, found {found}")
        # numpy cannot memory-map an empty file.
        if n_tokens == 0:
            self._tokens = np.zeros(0, dtype=self.dtype)
        else:
            self._tokens = np.memmap(self.bin_path, mode="r", dtype=self.dtype.newbyteorder("<"))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self._tokens.size)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx (to its end if length is None)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"{self.prefix}: sequence {idx} out of range (0..{n - 1})")
        idx %= n
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) outside "
                             f"sequence {idx} of length {size}")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id in the .bin, read in chunks so memory stays bounded."""
        # Megatron's format allows float dtypes, but token ids are integers: a float code
        # in a token dataset means a damaged .idx (int32 <-> float32 keep the .bin's size).
        if self.dtype.kind not in "iu":
            self._fail(self.idx_path, f"dtype {self.dtype} cannot hold token ids (a token "
                                      f"dataset needs an integer dtype; damaged dtype code?)")
        if self._tokens.size == 0:
            raise ValueError(f"{self.bin_path}: no tokens")
        chunks = [self._tokens[i:i + _SCAN_CHUNK] for i in range(0, self._tokens.size, _SCAN_CHUNK)]
        return int(min(c.min() for c in chunks)), int(max(c.max() for c in chunks))

    def max_token(self) -> int:
        """Largest token id in the .bin."""
        return self.token_range()[1]
