"""MMIDIDX files: read hand-made reference files, write identical bytes, reject bad files."""

import os
import struct

import numpy as np
import pytest

from megaulysses.data import indexed as indexed_module
from megaulysses.data.indexed import (DTYPE_CODES, IndexedDataset, IndexedDatasetError,
                                      IndexedDatasetWriter, dataset_exists, optimal_dtype)

# documents -> sequences -> tokens; one empty sequence on purpose
DOCUMENTS = [[[5, 6, 7]], [[1], [2, 3], []], [[65000, 0, 9, 9]]]


def write_reference(prefix, code, fmt, documents):
    """Write .bin/.idx straight from the format description, independent of our writer."""
    lengths, pointers, doc_indices, data = [], [], [0], b""
    for document in documents:
        for sequence in document:
            pointers.append(len(data))
            lengths.append(len(sequence))
            data += b"".join(struct.pack(fmt, t) for t in sequence)
        doc_indices.append(len(lengths))
    index = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    index += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
    index += b"".join(struct.pack("<i", n) for n in lengths)
    index += b"".join(struct.pack("<q", p) for p in pointers)
    index += b"".join(struct.pack("<q", d) for d in doc_indices)
    with open(prefix + ".idx", "wb") as f:
        f.write(index)
    with open(prefix + ".bin", "wb") as f:
        f.write(data)


def write_ours(prefix, dtype, documents):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for document in documents:
            for sequence in document:
                writer.add_item(sequence)
            writer.end_document()


def read_bytes(prefix):
    return tuple(open(prefix + ext, "rb").read() for ext in (".idx", ".bin"))


FORMATS = [(8, "<H", np.uint16), (4, "<i", np.int32)]


@pytest.mark.parametrize("code,fmt,dtype", FORMATS)
def test_reads_reference_file(tmp_path, code, fmt, dtype):
    prefix = str(tmp_path / "ref")
    write_reference(prefix, code, fmt, DOCUMENTS)
    ds = IndexedDataset(prefix)
    sequences = [s for d in DOCUMENTS for s in d]
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(sequences)
    assert ds.sequence_lengths.dtype == np.int32
    assert ds.sequence_pointers.dtype == np.int64
    assert list(ds.document_indices) == [0, 1, 4, 5]
    for i, sequence in enumerate(sequences):
        assert ds.get(i).tolist() == sequence
    assert ds.get(4, offset=1, length=2).tolist() == [0, 9]
    assert ds.max_token() == 65000


@pytest.mark.parametrize("code,fmt,dtype", FORMATS)
def test_writer_matches_reference_bytes(tmp_path, code, fmt, dtype):
    write_reference(str(tmp_path / "ref"), code, fmt, DOCUMENTS)
    write_ours(str(tmp_path / "ours"), dtype, DOCUMENTS)
    assert read_bytes(str(tmp_path / "ours")) == read_bytes(str(tmp_path / "ref"))


def test_add_document_and_merge_match_single_writer(tmp_path):
    docs = [[1, 2, 3], [4], [5, 6]]
    with IndexedDatasetWriter(str(tmp_path / "all"), np.uint16) as w:
        for d in docs:
            w.add_document(d)
    for name, part in (("a", docs[:1]), ("b", docs[1:])):
        with IndexedDatasetWriter(str(tmp_path / name), np.uint16) as w:
            for d in part:
                w.add_document(d)
    with IndexedDatasetWriter(str(tmp_path / "merged"), np.uint16) as w:
        w.merge(str(tmp_path / "a"))
        w.merge(str(tmp_path / "b"))
    assert read_bytes(str(tmp_path / "merged")) == read_bytes(str(tmp_path / "all"))


def test_failed_write_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([1, 2])
            raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []
    assert not dataset_exists(prefix)


def test_nothing_under_final_name_before_finalize(tmp_path):
    prefix = str(tmp_path / "x")
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add_document([1, 2])
    assert not dataset_exists(prefix)
    w.finalize()
    assert dataset_exists(prefix)
    assert sorted(os.listdir(tmp_path)) == ["x.bin", "x.idx"]


def test_token_out_of_dtype_range_is_refused(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as w:
        with pytest.raises(ValueError, match="does not fit"):
            w.add_item([70000])


def test_empty_dataset(tmp_path):
    write_ours(str(tmp_path / "e"), np.uint16, [])
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and list(ds.document_indices) == [0]


def test_max_token_in_chunks(tmp_path, monkeypatch):
    write_ours(str(tmp_path / "m"), np.int32, [[[3, 1, 4, 1, 5, 9, 2, 6]]])
    monkeypatch.setattr(indexed_module, "_SCAN_CHUNK", 3)
    assert IndexedDataset(str(tmp_path / "m")).max_token() == 9


def test_get_bounds(tmp_path):
    write_ours(str(tmp_path / "g"), np.uint16, [[[1, 2, 3]]])
    ds = IndexedDataset(str(tmp_path / "g"))
    with pytest.raises(IndexError):
        ds.get(1)
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)


def test_dtype_codes_and_optimal_dtype():
    assert DTYPE_CODES[8] == np.uint16 and DTYPE_CODES[4] == np.int32
    assert DTYPE_CODES[1] == np.uint8 and DTYPE_CODES[5] == np.int64
    assert optimal_dtype(4096) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32


# ---------------------------------------------------------------- corrupt files


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    write_reference(prefix, 8, "<H", [[[1, 2, 3, 4]], [[5, 6]]])
    return prefix


def _truncate(path, n_bytes):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - n_bytes)


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_truncated_bin(good):
    _truncate(good + ".bin", 2)
    with pytest.raises(IndexedDatasetError, match=r"good\.bin: truncated: expected 12 bytes, "
                                                  r"found 10"):
        IndexedDataset(good)


def test_truncated_idx(good):
    _truncate(good + ".idx", 1)
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: truncated"):
        IndexedDataset(good)


def test_bad_magic(good):
    _patch(good + ".idx", 0, b"XXIDIDX")
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: bad magic"):
        IndexedDataset(good)


def test_bad_dtype_code(good):
    _patch(good + ".idx", 17, b"\x63")
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: unknown dtype code 99"):
        IndexedDataset(good)


def test_bad_version(good):
    _patch(good + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: unsupported version 2"):
        IndexedDataset(good)


def test_inconsistent_pointers(good):
    # second pointer lives after the header (34 bytes) and two int32 lengths
    _patch(good + ".idx", 34 + 8 + 8, struct.pack("<q", 4))
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: sequence pointers"):
        IndexedDataset(good)


def test_missing_file(good):
    os.remove(good + ".bin")
    assert not dataset_exists(good)
    with pytest.raises(IndexedDatasetError, match=r"good\.bin: file not found"):
        IndexedDataset(good)


def test_error_is_a_value_error():
    assert issubclass(IndexedDatasetError, ValueError)
