"""Damaged data (issue 15, item 3).

A broken .bin/.idx or a bad --data-path blend weight is one line on stderr naming the
file (or the flag) and what is wrong, exit code 2, before any training. A damaged cache,
or one made for other settings or data, is rebuilt with a warning naming the cache file,
and the rebuilt indices equal a fresh build.

The datasets are real Megatron files written by the repo's own writer, then damaged with
byte edits at the offsets of the format (see megaulysses/data/indexed.py).
"""

import json
import logging
import os
import shutil
import struct
from typing import Callable, NamedTuple

import numpy as np
import pytest

from helpers import TINY
from megaulysses.config import ConfigError, parse_args
from megaulysses.data import gpt_dataset
from megaulysses.training.data import TOKEN_RANGES, build_datasets
from megaulysses.data.gpt_dataset import (BlendedDataset, GPTDataset,
                                          build_train_valid_test_datasets)
from megaulysses.data.indexed import HEADER_SIZE, IndexedDataset, IndexedDatasetWriter

VOCAB = 1000
N_SEQ, SEQ_LEN = 20, 50  # one sequence per document

# Byte offsets in the .idx: version after the 9-byte magic, then the dtype code; after
# the header: int32 lengths, int64 pointers, int64 document indices (N_SEQ + 1 of them).
VERSION, DTYPE_CODE = 9, 17
LENGTHS, POINTERS, DOCS = HEADER_SIZE, HEADER_SIZE + 4 * N_SEQ, HEADER_SIZE + 12 * N_SEQ


def write_corpus(prefix, dtype=np.uint16, high=VOCAB, seed=0, seq_len=SEQ_LEN) -> str:
    rng = np.random.RandomState(seed)
    with IndexedDatasetWriter(prefix, dtype) as w:
        for _ in range(N_SEQ):
            w.add_document(rng.randint(0, high, seq_len))
    return prefix


@pytest.fixture
def corpus(tmp_path) -> str:
    return write_corpus(str(tmp_path / "corpus"))


def patch(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def append(path, data: bytes):
    with open(path, "ab") as f:
        f.write(data)


# ---------------------------------------------------------------- end to end: exit 2


def run_main(args, capfd) -> tuple[int, str, str]:
    import pretrain_gpt
    capfd.readouterr()
    rc = pretrain_gpt.main(list(args))
    out, err = capfd.readouterr()
    return rc, out, err


def flags(tmp_path, data_path: list, vocab=VOCAB) -> list:
    return TINY + ["--train-iters", "1", "--eval-iters", "0", "--lr-warmup-iters", "0",
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
                   "--data-path", *data_path, "--data-cache-path", str(tmp_path / "cache"),
                   "--metrics-jsonl", str(tmp_path / "metrics.jsonl")]


def assert_refused(tmp_path, capfd, data_path: list, needles: list, vocab=VOCAB,
                   flag="--data-path") -> str:
    """Exit 2, exactly one stderr line naming the flag and the needles, nothing trained."""
    rc, out, err = run_main(flags(tmp_path, data_path, vocab), capfd)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, out[-2000:] + err
    assert "Traceback" not in out + err
    assert lines[0].startswith(f"error: {flag}: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()  # no training step ran
    assert "iteration" not in out
    return lines[0]


def _int32_corpus(prefix):
    return write_corpus(prefix, np.int32)


def _wide_uint16_corpus(prefix):
    # Token ids up to 40000: above int16's 32767, so reading them as int16 makes them negative.
    return write_corpus(prefix, np.uint16, high=40000)


def _empty_corpus(prefix):
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([])
    return prefix


class Damage(NamedTuple):
    make: Callable  # prefix -> prefix of a good corpus
    damage: Callable  # prefix -> None: the byte edit
    needles: list  # what the one line says, besides the flag and the file
    vocab: int = VOCAB
    flag: str = "--data-path"


DAMAGE = {k: Damage(*v) for k, v in {
    "idx-wrong-magic": (write_corpus, lambda p: patch(p + ".idx", 0, b"NOTMMIDX\x00"),
                        [".idx: bad magic", "not an MMIDIDX index file"]),
    "idx-wrong-version": (write_corpus, lambda p: patch(p + ".idx", VERSION, struct.pack("<Q", 7)),
                          [".idx: unsupported version 7 (expected 1)"]),
    "idx-unknown-dtype-code": (write_corpus, lambda p: patch(p + ".idx", DTYPE_CODE, b"\x63"),
                               [".idx: unknown dtype code 99"]),
    "idx-truncated-header": (write_corpus, lambda p: truncate(p + ".idx", 20),
                             [".idx: truncated: header needs 34 bytes, found 20"]),
    "idx-truncated": (write_corpus, lambda p: truncate(p + ".idx", DOCS + 8),
                      [".idx: truncated: expected 442 bytes for 20 sequences and 21 document "
                       "entries, found 282"]),
    "idx-trailing-bytes": (write_corpus, lambda p: append(p + ".idx", b"\x00" * 8),
                           [".idx: trailing bytes: expected 442 bytes", "found 450"]),
    "bin-truncated": (write_corpus, lambda p: truncate(p + ".bin", 1000),
                      [".bin: truncated: expected 2000 bytes, found 1000"]),
    "bin-too-long": (write_corpus, lambda p: append(p + ".bin", b"\x01\x00"),
                     [".bin: trailing bytes: expected 2000 bytes, found 2002"]),
    "idx-pointer-out-of-range": (
        write_corpus, lambda p: patch(p + ".idx", POINTERS + 8 * 3, struct.pack("<q", 10**9)),
        [".idx: sequence pointers do not match the sequence lengths"]),
    "idx-document-index-out-of-range": (
        write_corpus, lambda p: patch(p + ".idx", DOCS + 8 * N_SEQ, struct.pack("<q", 99)),
        [".idx: document indices must rise from 0 to the sequence count 20"]),
    "idx-document-index-falls": (
        write_corpus, lambda p: patch(p + ".idx", DOCS + 8 * 5, struct.pack("<q", 2)),
        [".idx: document indices must rise from 0 to the sequence count 20"]),
    "idx-negative-length": (
        write_corpus, lambda p: patch(p + ".idx", LENGTHS, struct.pack("<i", -1)),
        [".idx: negative sequence length"]),
    "idx-missing": (write_corpus, lambda p: os.remove(p + ".idx"),
                    [".bin/.idx not found (give the prefix, without .bin or .idx)"]),
    # Same-width dtype codes keep every size and pointer valid; the tokens tell.
    "dtype-code-unsigned-to-signed": (
        _wide_uint16_corpus, lambda p: patch(p + ".idx", DTYPE_CODE, b"\x03"),
        [".bin holds token id -", "token ids must be >= 0 (damaged .bin, or a wrong dtype "
                                  "code in"], 40000),
    "dtype-code-int-to-float": (
        _int32_corpus, lambda p: patch(p + ".idx", DTYPE_CODE, b"\x07"),
        [".idx: dtype float32 cannot hold token ids (a token dataset needs an integer "
         "dtype; damaged dtype code?)"]),
    "bin-garbage-negative-token": (
        _int32_corpus, lambda p: patch(p + ".bin", 4 * 77, b"\xff\xff\xff\xff"),
        [".bin holds token id -1: token ids must be >= 0"]),
    "bin-garbage-token-beyond-vocab": (
        write_corpus, lambda p: patch(p + ".bin", 2 * 77, b"\xff\xff"),
        [".bin holds token id 65535 but the vocabulary has 1001 entries"], VOCAB,
        "--tokenizer-model/--vocab-size"),
    "bin-no-tokens": (_empty_corpus, lambda p: None, [".bin: no tokens"]),
}.items()}


@pytest.mark.parametrize("case", DAMAGE, ids=list(DAMAGE))
def test_damaged_dataset_is_one_line_and_trains_nothing(case, tmp_path, capfd):
    case = DAMAGE[case]
    prefix = case.make(str(tmp_path / "corpus"))
    case.damage(prefix)
    line = assert_refused(tmp_path, capfd, [prefix], case.needles, case.vocab, case.flag)
    assert prefix in line


def test_unreadable_file_is_one_line(corpus, tmp_path, capfd, monkeypatch):
    """No read permission (simulated: the tests may run as root, who reads anything)."""
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(np, "memmap", refuse)
    assert_refused(tmp_path, capfd, [corpus], [f"{corpus}.idx: cannot read (Permission denied)"])


def test_damaged_member_of_a_blend_is_named(corpus, tmp_path, capfd):
    bad = write_corpus(str(tmp_path / "other"), seed=1)
    truncate(bad + ".bin", 10)
    line = assert_refused(tmp_path, capfd, ["0.5", corpus, "0.5", bad],
                          [f"{bad}.bin: truncated: expected 2000 bytes, found 10"])
    assert corpus + "." not in line


# ---------------------------------------------------------------- blend weights


@pytest.mark.parametrize("weights,needle", [
    (["-1", "1"], "weight '-1' for {a} is negative"),
    (["0", "0"], "weight '0' for {a} is zero"),
    (["1", "0"], "weight '0' for {b} is zero"),
    (["abc", "1"], "weight 'abc' for {a} is not a number"),
    (["nan", "1"], "weight 'nan' for {a} is not a finite number"),
    (["1", "inf"], "weight 'inf' for {b} is not a finite number"),
    (["1e999", "1"], "weight '1e999' for {a} is not a finite number"),
], ids=["negative", "all-zero", "one-zero", "abc", "nan", "inf", "overflow"])
def test_bad_blend_weight_is_one_line(weights, needle, tmp_path, capfd):
    a, b = write_corpus(str(tmp_path / "a")), write_corpus(str(tmp_path / "b"), seed=1)
    assert_refused(tmp_path, capfd, [weights[0], a, weights[1], b],
                   [needle.format(a=a, b=b), "blend weights must be positive numbers"])


def test_weight_without_prefix_is_one_line(corpus, tmp_path, capfd):
    assert_refused(tmp_path, capfd, ["0.5", corpus, "0.5"],
                   ["3 values", "weight-prefix pairs like '0.3 A 0.7 B' need an even number"])


# ---------------------------------------------------------------- the index cache


SAMPLES, SEQ = 30, 16


def gpt(corpus, cache, seed=1, seq=SEQ) -> GPTDataset:
    return GPTDataset(IndexedDataset(corpus), np.arange(N_SEQ), SAMPLES, seq, seed,
                      None if cache is None else str(cache), "train")


def assert_same_indices(ds, fresh):
    for kind in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(ds, kind), getattr(fresh, kind))


def cache_file(cache, kind) -> str:
    [name] = [f for f in os.listdir(cache) if f.endswith(f"_{kind}.npy")]
    return os.path.join(cache, name)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _garble_data(path):  # same size, so only a checksum can tell
    patch(path, os.path.getsize(path) - 200, b"\x13" * 64)


def _garble_header(path):
    patch(path, 0, b"garbage!")


def _old_format(path):  # a plain .npy with no trailer, as the version before wrote them
    np.save(path, np.load(path))


NO_TRAILER = "no checksum trailer (truncated, or written by an older version)"
CACHE_DAMAGE = {
    "truncated": (lambda p: truncate(p, os.path.getsize(p) // 2), NO_TRAILER),
    "empty": (lambda p: truncate(p, 0), NO_TRAILER),
    "garbage-bytes": (_garble_data, "checksum mismatch (damaged on disk)"),
    "garbage-header": (_garble_header, "checksum mismatch (damaged on disk)"),
    "written-by-older-version": (_old_format, NO_TRAILER),
    "missing": (os.remove, "missing (a run stopped while writing the cache?)"),
}


@pytest.mark.parametrize("kind", ["document_index", "sample_index", "shuffle_index"])
@pytest.mark.parametrize("how", CACHE_DAMAGE, ids=list(CACHE_DAMAGE))
def test_damaged_index_cache_is_rebuilt_with_a_warning(corpus, tmp_path, caplog, how, kind):
    cache = tmp_path / "cache"
    gpt(corpus, cache)
    damage, reason = CACHE_DAMAGE[how]
    path = cache_file(cache, kind)
    damage(path)
    caplog.clear()
    ds = gpt(corpus, cache)
    assert warnings_of(caplog) == [f"dataset cache {path}: {reason}; rebuilding it"]
    assert not ds.loaded_from_cache
    assert_same_indices(ds, gpt(corpus, None))
    # The rebuilt file is whole again: the next run loads it, silently.
    caplog.clear()
    again = gpt(corpus, cache)
    assert again.loaded_from_cache and warnings_of(caplog) == []
    assert_same_indices(again, ds)


def test_cache_made_for_other_settings_is_rebuilt_with_a_warning(corpus, tmp_path, caplog):
    """A file under this entry's name (copied or renamed) that was built for other
    settings: its trailer says so."""
    cache, other = tmp_path / "cache", tmp_path / "other"
    gpt(corpus, other, seed=2)
    gpt(corpus, cache, seed=1)
    for kind in ("document_index", "sample_index", "shuffle_index"):
        shutil.copy(cache_file(other, kind), cache_file(cache, kind))
    caplog.clear()
    ds = gpt(corpus, cache, seed=1)
    assert warnings_of(caplog) == [f"dataset cache {cache_file(cache, 'document_index')}: "
                                   "made for other settings or data; rebuilding it"]
    assert not ds.loaded_from_cache
    assert_same_indices(ds, gpt(corpus, None, seed=1))


@pytest.mark.parametrize("change", [{"seed": 2}, {"seq": 8}], ids=["seed", "seq-length"])
def test_other_settings_never_reuse_the_cache(corpus, tmp_path, change):
    cache = tmp_path / "cache"
    gpt(corpus, cache)
    ds = gpt(corpus, cache, **change)
    assert not ds.loaded_from_cache
    assert_same_indices(ds, gpt(corpus, None, **change))
    assert len(os.listdir(cache)) == 6  # both entries kept: switching back costs nothing
    assert gpt(corpus, cache).loaded_from_cache


def test_rewritten_data_never_reuses_the_cache(corpus, tmp_path):
    """New documents at the same path, same cache dir: the indices are those of the new data."""
    cache = tmp_path / "cache"
    old = gpt(corpus, cache)
    write_corpus(corpus, seed=5, seq_len=SEQ_LEN // 2)
    ds = gpt(corpus, cache)
    assert not ds.loaded_from_cache
    assert_same_indices(ds, gpt(corpus, None))
    assert not np.array_equal(ds.sample_index, old.sample_index)


def test_damaged_blend_cache_is_rebuilt_with_a_warning(tmp_path, caplog):
    a, b = write_corpus(str(tmp_path / "a")), write_corpus(str(tmp_path / "b"), seed=1)

    def build(cache):
        train, _, _ = build_train_valid_test_datasets([a, b], [0.3, 0.7], "1", (40, 0, 0), SEQ,
                                                      1, cache and str(cache))
        return train
    cache = tmp_path / "cache"
    build(cache)
    path = cache_file(cache, "dataset_index")
    _garble_data(path)
    caplog.clear()
    train = build(cache)
    assert isinstance(train, BlendedDataset) and not train.loaded_from_cache
    assert warnings_of(caplog) == [f"dataset cache {path}: checksum mismatch (damaged on "
                                   "disk); rebuilding it"]
    fresh = build(None)
    np.testing.assert_array_equal(train.dataset_index, fresh.dataset_index)
    np.testing.assert_array_equal(train.dataset_sample_index, fresh.dataset_sample_index)


def test_crash_while_writing_the_cache_leaves_nothing_trusted(corpus, tmp_path, caplog,
                                                              monkeypatch):
    """The disk fills up half-way through the second file: no partial file under a final
    name (temporary file + rename), and the next run rebuilds what is missing."""
    cache, real_save, calls = tmp_path / "cache", np.save, []

    def save_then_fail(f, array, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"\x93NUMPY half")
            raise OSError(28, "No space left on device")
        real_save(f, array, **kwargs)
    monkeypatch.setattr(gpt_dataset.np, "save", save_then_fail)
    ds = gpt(corpus, cache)
    monkeypatch.undo()
    assert warnings_of(caplog) == [f"cannot cache dataset indices in {cache}: [Errno 28] No "
                                   "space left on device"]
    [left] = os.listdir(cache)  # no half file, no temporary file
    assert left.endswith("_document_index.npy")
    caplog.clear()
    again = gpt(corpus, cache)
    [warning] = warnings_of(caplog)
    assert warning.endswith("_sample_index.npy: missing (a run stopped while writing the "
                            "cache?); rebuilding it")
    assert_same_indices(again, ds)
    assert gpt(corpus, cache).loaded_from_cache


# ---------------------------------------------------------------- the token range cache


def data_cfg(corpus, tmp_path, vocab=VOCAB):
    return parse_args(flags(tmp_path, [corpus], vocab))


def test_damaged_token_range_cache_is_rebuilt_with_a_warning(corpus, tmp_path, caplog):
    cfg = data_cfg(corpus, tmp_path)
    ranges = tmp_path / "cache" / TOKEN_RANGES
    for content, reason in [(b'{"trunc', "unreadable"), (b"\xff\xfe garbage", "unreadable"),
                            (b"[1, 2]", "not a token range cache (a JSON list)"),
                            (json.dumps({os.path.abspath(corpus): {"range": "x"}}).encode(),
                             f"the entry for {os.path.abspath(corpus)} is malformed")]:
        ranges.parent.mkdir(exist_ok=True)
        ranges.write_bytes(content)
        caplog.clear()
        build_datasets(cfg, VOCAB + 1)
        [warning] = warnings_of(caplog)
        assert warning.startswith(f"{ranges}: {reason}"), warning
        entry = json.loads(ranges.read_text())[os.path.abspath(corpus)]
        assert entry["range"] == list(IndexedDataset(corpus).token_range())


def test_token_range_cache_is_not_used_for_replaced_data(corpus, tmp_path, caplog):
    """Same path, same size, other tokens (one beyond the vocabulary): scanned again."""
    cfg = data_cfg(corpus, tmp_path)
    build_datasets(cfg, VOCAB + 1)
    write_corpus(corpus, high=VOCAB + 50, seed=3)
    caplog.clear()
    with pytest.raises(ConfigError, match=r"--vocab-size: .*holds token id 10[0-4]\d but "):
        build_datasets(cfg, VOCAB + 1)
    assert warnings_of(caplog) == [f"{tmp_path / 'cache' / TOKEN_RANGES}: the entry for "
                                   f"{os.path.abspath(corpus)} was read from other data; "
                                   f"rescanning {corpus}.bin"]


def test_token_range_cache_is_not_used_after_a_dtype_code_change(tmp_path):
    """uint16 -> int16 in the .idx keeps the .bin untouched; the cached range must not hide
    the negative token ids it now holds."""
    corpus = _wide_uint16_corpus(str(tmp_path / "corpus"))
    cfg = data_cfg(corpus, tmp_path, vocab=40000)
    build_datasets(cfg, 40001)
    patch(corpus + ".idx", DTYPE_CODE, b"\x03")
    with pytest.raises(ConfigError, match=r"^--data-path: .*holds token id -\d+: token ids must "
                                          r"be >= 0"):
        build_datasets(cfg, 40001)


def test_damaged_caches_end_to_end_train_with_warnings(corpus, tmp_path, capfd, caplog):
    """pretrain_gpt with every cache file garbled: warnings, then training as usual."""
    args = flags(tmp_path, [corpus])
    assert run_main(args, capfd)[0] == 0
    cache = tmp_path / "cache"
    for name in os.listdir(cache):
        _garble_header(cache / name)
    os.remove(tmp_path / "metrics.jsonl")
    caplog.clear()
    rc, out, err = run_main(args, capfd)
    assert rc == 0 and "Traceback" not in out + err
    assert [json.loads(r)["iteration"] for r in open(tmp_path / "metrics.jsonl")] == [1]
    warnings = warnings_of(caplog)
    assert any(w.startswith(f"{cache / TOKEN_RANGES}: unreadable") for w in warnings), warnings
    assert any(w.startswith(f"dataset cache {cache}") and "checksum mismatch" in w
               for w in warnings), warnings
