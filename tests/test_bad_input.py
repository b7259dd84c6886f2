"""Bad input: one line on stderr naming the flag (or file) and the rule, exit code 2."""

import os
import shutil
import struct
import subprocess

import pytest

from helpers import REPO, TINY, run_subprocess

DATA = os.path.join(REPO, "data", "shakespeare_text_document")


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for n in needles:
        assert n in err[0], err[0]


@pytest.mark.parametrize("args,needles", [
    (["--hidden-size", "100", "--num-attention-heads", "8"],
     ["--hidden-size", "divisible by --num-attention-heads"]),
    (["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "3"],
     ["--num-attention-heads", "--num-query-groups"]),
    (["--global-batch-size", "10", "--micro-batch-size", "4"],
     ["--global-batch-size", "divisible by --micro-batch-size"]),
    (["--seq-length", "512", "--max-position-embeddings", "256"],
     ["--seq-length", "--max-position-embeddings"]),
    (["--num-layers", "two"], ["--num-layers", "integer"]),
    (["--bf16", "--fp16"], ["--bf16"]),
    (["--split", "1,2,x"], ["--split"]),
    (["--lr-warmup-iters", "50", "--train-iters", "10"], ["--lr-warmup-iters"]),
    (["--zero-stage", "4"], ["--zero-stage", "invalid choice: 4"]),
    (["--grad-reduce-dtype", "fp16"], ["--grad-reduce-dtype", "invalid choice: 'fp16'"]),
    (["--keep-last", "2"], ["--keep-last", "needs --save"]),
    (["--async-save"], ["--async-save", "needs --save"]),
    (["--exit-duration-in-mins", "0"], ["--exit-duration-in-mins", "must be > 0"]),
], ids=["heads", "query-groups", "batch", "positions", "int", "precision", "split", "warmup",
        "zero-stage", "grad-reduce-dtype", "keep-last", "async-save", "exit-duration"])
def test_inconsistent_flags(args, needles):
    assert_one_line_error(run_subprocess(args), *needles)


def run_main(args, capfd) -> subprocess.CompletedProcess:
    """pretrain_gpt.main in this process (no interpreter start-up, no torch import):
    its exit code and what it printed. The subprocess cases above and below show the
    real command line behaves the same."""
    import pretrain_gpt
    capfd.readouterr()
    rc = pretrain_gpt.main(list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def test_missing_data_file(capfd):
    proc = run_main(TINY + ["--data-path", "/nonexistent/corpus_text_document"], capfd)
    assert_one_line_error(proc, "--data-path", "/nonexistent/corpus_text_document",
                          "without .bin or .idx")


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_data_path_to_the_bin_or_idx_file_means_its_prefix(suffix, tmp_path):
    """Issue 15, item 7: `--data-path X.bin` used to say `X.bin.bin/.idx not found`."""
    from megaulysses.config import parse_args
    from megaulysses.training.data import build_datasets, load_tokenizer
    cfg = parse_args(TINY + ["--data-path", DATA + suffix,
                             "--data-cache-path", str(tmp_path / "cache")])
    train, valid, _ = build_datasets(cfg, load_tokenizer(cfg).vocab_size)
    assert len(train) >= 6 * 4 and valid is not None


def test_missing_tokenizer_file(capfd):
    proc = run_main(TINY + ["--tokenizer-model", "/nonexistent/tok.model"], capfd)
    assert_one_line_error(proc, "--tokenizer-model", "/nonexistent/tok.model")


def test_data_vocabulary_larger_than_the_model(capfd):
    proc = run_main(TINY + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"], capfd)
    assert_one_line_error(proc, "--vocab-size", "4095", "1001")


def copy_data(tmp_path):
    prefix = str(tmp_path / "corpus")
    for ext in (".bin", ".idx"):
        shutil.copy(DATA + ext, prefix + ext)
    return prefix


def test_truncated_bin_is_reported_with_its_file(tmp_path, capfd):
    prefix = copy_data(tmp_path)
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 1000)
    proc = run_main(TINY + ["--data-path", prefix], capfd)
    assert_one_line_error(proc, "--data-path", prefix + ".bin", "truncated")


def test_corrupt_idx_is_reported_with_its_file(tmp_path, capfd):
    prefix = copy_data(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.write(struct.pack("<9s", b"NOTMMIDX\x00"))
    proc = run_main(TINY + ["--data-path", prefix], capfd)
    assert_one_line_error(proc, "--data-path", prefix + ".idx")


def test_load_of_unreadable_directory_never_starts_from_scratch(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("not a checkpoint")
    proc = run_subprocess(TINY + ["--load", str(tmp_path / "ck")])
    assert_one_line_error(proc, "--load", "holds no checkpoint")
    assert "iteration" not in proc.stdout.split("model:")[-1]  # no training happened


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A committed checkpoint of TINY after 2 iterations."""
    import pretrain_gpt
    ck = tmp_path_factory.mktemp("saved") / "ck"
    assert pretrain_gpt.main(TINY + ["--train-iters", "2", "--eval-iters", "0",
                                     "--save", str(ck)]) == 0
    return ck


def _truncate_a_shard(ck):
    shard = [f for f in os.listdir(ck / "iter_0000002") if f.endswith(".distcp")][0]
    with open(ck / "iter_0000002" / shard, "r+b") as f:
        f.truncate(100)


def _break(ck, how: str):
    """Damage a copy of the saved checkpoint; returns the --load path to use."""
    it = ck / "iter_0000002"
    if how == "corrupt":
        _truncate_a_shard(ck)
    elif how == "partial":
        os.remove(it / ".metadata")
    elif how in ("uncommitted", "uncommitted-iter-dir"):
        os.remove(it / "COMMITTED")
        return it if how == "uncommitted-iter-dir" else ck
    elif how == "missing":
        shutil.rmtree(ck)
    return ck


@pytest.mark.parametrize("how,flags,needles", [
    ("missing", [], ["--load", "does not exist", "pass the same directory to --save"]),
    ("corrupt", [], ["--load", "corrupt or incomplete"]),
    ("partial", [], ["--load", "corrupt or incomplete", ".metadata"]),
    ("uncommitted", [], ["--load", "holds no committed checkpoint"]),
    ("uncommitted-iter-dir", [], ["--load", "no COMMITTED marker"]),
    ("intact", ["--num-layers", "3"], ["--load", "--num-layers=2", "3"]),
    ("intact", ["--no-swiglu"], ["--load", "--swiglu=True", "False"]),
    ("intact", ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"],
     ["--load", "vocabulary of", "--vocab-size 500 (NullTokenizer) has 501"]),
], ids=["missing", "corrupt", "partial", "uncommitted", "uncommitted-iter-dir", "shape",
        "architecture", "vocabulary"])
def test_bad_checkpoint_is_one_line_and_trains_nothing(saved, tmp_path, capfd, how, flags,
                                                       needles):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    load = _break(ck, how)
    metrics = tmp_path / "m.jsonl"
    proc = run_main(TINY + ["--load", str(load), "--metrics-jsonl", str(metrics)] + flags,
                    capfd)
    assert_one_line_error(proc, *needles)
    assert not metrics.exists()  # no training happened
