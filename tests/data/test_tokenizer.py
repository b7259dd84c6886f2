"""Tokenizers: SentencePiece (a tiny one trained here, and the bundled one) and Null."""

import importlib.util
import json
import os

import pytest

from megaulysses.data.tokenizer import (NullTokenizer, SentencePieceTokenizer,
                                        build_tokenizer)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_MODEL = os.path.join(REPO, "data", "shakespeare_tok.model")
CORPUS = os.path.join(REPO, "data", "shakespeare.jsonl")
SAMPLE = "HAMLET:\nTo be, or not to be: that is the question:\n\n  Whether 'tis nobler — 1603\n"


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 400-piece BPE model trained on the first scenes of the bundled corpus."""
    directory = tmp_path_factory.mktemp("tok")
    corpus = directory / "small.jsonl"
    with open(CORPUS, encoding="utf-8") as src:
        corpus.write_text("".join(next(src) for _ in range(20)), encoding="utf-8")
    train = load_tool("train_tokenizer")
    return train.train_tokenizer([str(corpus)], str(directory / "tiny"), vocab_size=400)


def test_tiny_model_roundtrip(tiny_model):
    tok = SentencePieceTokenizer(tiny_model)
    assert tok.vocab_size == 400 and tok.eod == 2
    ids = tok.tokenize(SAMPLE)
    assert all(isinstance(i, int) and 0 <= i < 400 for i in ids)
    assert tok.detokenize(ids) == SAMPLE  # exact, newlines and odd characters included


def test_training_is_deterministic(tiny_model):
    train = load_tool("train_tokenizer")
    corpus = os.path.join(os.path.dirname(tiny_model), "small.jsonl")
    # The model file records its own prefix, so compare the vocabularies, not bytes.
    again = train.train_tokenizer([corpus], tiny_model[:-len(".model")] + "_again",
                                  vocab_size=400)
    a, b = SentencePieceTokenizer(tiny_model), SentencePieceTokenizer(again)
    pieces = [a._sp.id_to_piece(i) for i in range(400)]
    assert pieces == [b._sp.id_to_piece(i) for i in range(400)]


def test_bundled_model_roundtrip():
    tok = build_tokenizer("SentencePieceTokenizer", BUNDLED_MODEL)
    assert tok.vocab_size == 4096 and tok.eod == 2
    with open(CORPUS, encoding="utf-8") as f:
        text = json.loads(f.readline())["text"]
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.detokenize(tok.tokenize(SAMPLE)) == SAMPLE
    # common words are single pieces
    assert len(tok.tokenize(" the king")) == 2


def test_detokenize_accepts_numpy_ids():
    import numpy as np

    tok = SentencePieceTokenizer(BUNDLED_MODEL)
    ids = np.array(tok.tokenize("Good night, sweet prince"), dtype=np.int64)
    assert tok.detokenize(ids) == "Good night, sweet prince"


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("3 1  4\n15") == [3, 1, 4, 15]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    assert isinstance(build_tokenizer("NullTokenizer", vocab_size=100), NullTokenizer)


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="^--tokenizer-model: required"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ValueError, match="^--vocab-size: required"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="^--tokenizer-type: unknown"):
        build_tokenizer("TikTokenizer", BUNDLED_MODEL)
    with pytest.raises(ValueError, match="^--tokenizer-model: .*shakespeare_tok.model is not a "
                                         "Hugging Face tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", BUNDLED_MODEL)
    with pytest.raises(FileNotFoundError, match="^--tokenizer-model: file not found"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "missing.model"))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a protobuf")
    with pytest.raises(ValueError, match="^--tokenizer-model: .*garbage.model"):
        build_tokenizer("SentencePieceTokenizer", str(garbage))
    with pytest.raises(ValueError, match="^--vocab-size"):
        NullTokenizer(0)
