"""tools/preprocess_data.py and tools/train_tokenizer.py as command-line programs, and the
bundled corpus in data/."""

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megaulysses.data.indexed import IndexedDataset
from megaulysses.data.tokenizer import SentencePieceTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_MODEL = os.path.join(REPO, "data", "shakespeare_tok.model")
BUNDLED_PREFIX = os.path.join(REPO, "data", "shakespeare_text_document")
CORPUS = os.path.join(REPO, "data", "shakespeare.jsonl")


def run_tool(name, *args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", f"{name}.py"), *args],
                          capture_output=True, text=True, env=env, cwd=REPO)


def files_bytes(prefix):
    return tuple(open(prefix + ext, "rb").read() for ext in (".idx", ".bin"))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """40 scenes plus an empty document and a blank line, as .jsonl.gz."""
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl.gz"
    with open(CORPUS, encoding="utf-8") as src:
        lines = [next(src) for _ in range(40)]
    lines.insert(7, json.dumps({"text": ""}) + "\n")
    lines.insert(12, "\n")
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(lines)
    return str(path)


def preprocess(corpus, prefix, *extra):
    return run_tool("preprocess_data", "--input", corpus, "--output-prefix", prefix,
                    "--tokenizer-type", "SentencePieceTokenizer",
                    "--tokenizer-model", BUNDLED_MODEL, "--append-eod", *extra)


def test_preprocess_workers_give_identical_files(small_corpus, tmp_path):
    one = preprocess(small_corpus, str(tmp_path / "w1"), "--workers", "1")
    two = preprocess(small_corpus, str(tmp_path / "w2"), "--workers", "2", "--log-interval", "3")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert files_bytes(str(tmp_path / "w1_text_document")) == \
        files_bytes(str(tmp_path / "w2_text_document"))
    assert sorted(os.listdir(tmp_path)) == ["w1_text_document.bin", "w1_text_document.idx",
                                            "w2_text_document.bin", "w2_text_document.idx"]
    ds = IndexedDataset(str(tmp_path / "w1_text_document"))
    tok = SentencePieceTokenizer(BUNDLED_MODEL)
    assert len(ds) == 40 and ds.dtype == np.uint16  # the empty document is skipped
    with open(CORPUS, encoding="utf-8") as f:
        first = json.loads(f.readline())["text"]
    assert ds.get(0).tolist() == tok.tokenize(first) + [tok.eod]


def test_preprocess_null_tokenizer_several_keys(tmp_path):
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text('{"a": "1 2 3", "b": "7"}\n{"a": "", "b": "8 9"}\n')
    result = run_tool("preprocess_data", "--input", str(corpus), "--output-prefix",
                      str(tmp_path / "out"), "--json-keys", "a", "b",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                      "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr
    a, b = IndexedDataset(str(tmp_path / "out_a_document")), IndexedDataset(
        str(tmp_path / "out_b_document"))
    assert [a.get(i).tolist() for i in range(len(a))] == [[1, 2, 3, 10]]
    assert [b.get(i).tolist() for i in range(len(b))] == [[7, 10], [8, 9, 10]]


@pytest.mark.parametrize("content,needle", [
    ('{"text": "fine"}\n{"text": oops}\n', r"bad\.jsonl:2: invalid JSON"),
    ('{"text": "fine"}\n{"body": "x"}\n', r"bad\.jsonl:2: missing key 'text'"),
    ('{"text": 5}\n', r"bad\.jsonl:1: 'text' must be a string"),
])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_preprocess_bad_input(tmp_path, content, needle, workers):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    result = preprocess(str(bad), str(tmp_path / "out"), "--workers", workers)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(needle, lines[0]), result.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # nothing half-written


def test_preprocess_missing_input(tmp_path):
    result = preprocess(str(tmp_path / "nope.jsonl"), str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"preprocess_data.py: error: --input: file not found: {tmp_path / 'nope.jsonl'}"]


def test_preprocess_null_token_out_of_range(tmp_path):
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text('{"text": "1 2 300"}\n')
    result = run_tool("preprocess_data", "--input", str(corpus), "--output-prefix",
                      str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "10")
    assert result.returncode == 2 and "ids.jsonl:1: token id 300" in result.stderr


def test_train_tokenizer_cli(tmp_path):
    text = tmp_path / "plays.txt"
    with open(CORPUS, encoding="utf-8") as f:
        text.write_text("".join(json.loads(next(f))["text"] for _ in range(10)))
    result = run_tool("train_tokenizer", "--input", str(text), "--model-prefix",
                      str(tmp_path / "tok"), "--vocab-size", "350")
    assert result.returncode == 0, result.stderr
    assert os.path.isfile(tmp_path / "tok.model") and os.path.isfile(tmp_path / "tok.vocab")
    assert SentencePieceTokenizer(str(tmp_path / "tok.model")).vocab_size == 350


def test_train_tokenizer_missing_input(tmp_path):
    result = run_tool("train_tokenizer", "--input", str(tmp_path / "nope.txt"),
                      "--model-prefix", str(tmp_path / "tok"))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "nope.txt" in result.stderr


# ---------------------------------------------------------------- bundled corpus


def test_bundled_dataset_loads():
    ds = IndexedDataset(BUNDLED_PREFIX)
    tok = SentencePieceTokenizer(BUNDLED_MODEL)
    assert len(ds) > 100
    assert len(ds.document_indices) == len(ds) + 1  # one sequence per document
    assert ds.dtype == np.uint16
    assert ds.max_token() < tok.vocab_size
    # every document ends with eod, and only there
    for i in range(len(ds)):
        tokens = ds.get(i)
        assert tokens[-1] == tok.eod and tok.eod not in tokens[:-1]


def test_bundled_dataset_matches_jsonl():
    ds = IndexedDataset(BUNDLED_PREFIX)
    tok = SentencePieceTokenizer(BUNDLED_MODEL)
    with open(CORPUS, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    assert len(docs) == len(ds)
    assert {"text", "play", "scene"} <= set(docs[0])
    for i in (0, len(ds) // 2, len(ds) - 1):
        assert tok.detokenize(ds.get(i)[:-1]) == docs[i]["text"]
