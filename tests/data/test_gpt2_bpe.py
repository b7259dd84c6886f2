"""GPT2BPETokenizer (Megatron-LM's --tokenizer-type GPT2BPETokenizer --vocab-file
--merge-file) on a tiny byte-level BPE trained here with `tokenizers`: its ids equal
transformers' GPT-2 tokenizer's and those of GPT-2's algorithm written out below (
transformers 5 runs `tokenizers` too, so the plain one is the independent check), its
text round-trips, tools/preprocess_data.py writes its ids, pretrain_gpt.py trains,
evaluates, samples and checkpoints with it, the converter carries it, and bad files are
refused naming the flag. Nothing is downloaded."""

import contextlib
import importlib.util
import io
import itertools
import json
import math
import os
import re
import sys

import numpy as np
import pytest

from helpers import TINY, preprocess_texts, run_inprocess
from megaulysses.data.indexed import IndexedDataset
from megaulysses.data.tokenizer import GPT2_EOD, GPT2BPETokenizer, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "data", "shakespeare.jsonl")
TEXTS = [
    "Hello world", " Hello  world ", "", " ", "   ", "\n\n\t  \n", "trailing newline\n",
    "tab\tseparated\tand   runs of    spaces   ", "\r\nwindows\r\nlines\r\n",
    "it's we've they'll I'm you'd CAN'T 'tis", "digits 1603 and 42, 3.14159; -7e10 \u0664\u0662",
    "caf\u00e9 na\u00efve \u00fcber \u2603 \u6f22\u5b57 \U0001f600\U0001f9ea e\u0301 \u00c5ngstr\u00f6m",
    "no\u00a0break\u2003em\u200bzero-width \u0394\u03b9\u03bf\u03bd\u03cd\u03c3\u03b9\u03bf\u03c2",
    "a<|endoftext|>b <|endoftext|>", GPT2_EOD, "<|endoftext|>\n<|endoftext|>",
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n  -- Act II, sc. 2",
]
# GPT-2's pre-tokenizer (OpenAI's encoder.py, Megatron-LM's gpt2_tokenization.py).
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_FLAGS = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file"]


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def shakespeare(n: int, chars: int = 3000) -> list[str]:
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(next(f))["text"][:chars] for _ in range(n)]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(directory, vocab.json, merges.txt) of a 500-entry byte-level BPE trained on a few
    scenes, laid out as GPT-2's: <|endoftext|> is the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    directory = tmp_path_factory.mktemp("gpt2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=499, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(shakespeare(12) + TEXTS[10:13], trainer)
    vocab, merges = tok.model.save(str(directory))
    with open(vocab, encoding="utf-8") as f:
        entries = json.load(f)
    entries[GPT2_EOD] = len(entries)
    with open(vocab, "w", encoding="utf-8") as f:
        json.dump(entries, f, ensure_ascii=False)
    return str(directory), vocab, merges


def gpt2_encode(text: str, vocab: dict, merges: list) -> list[int]:
    """GPT-2's byte-level BPE written out plainly: split by GPT-2's pattern, write each
    piece's UTF-8 bytes as characters, then merge the lowest-ranked adjacent pair (every
    occurrence, left to right) until no pair has a rank."""
    import regex
    char, rank = byte_chars(), {pair: i for i, pair in enumerate(merges)}
    ids = []
    for piece in regex.findall(GPT2_SPLIT, text):
        word = [char[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            best = min(itertools.pairwise(word), key=lambda pair: rank.get(pair, math.inf))
            if best not in rank:
                break
            merged, i = [], 0
            while i < len(word):
                if tuple(word[i:i + 2]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids += [vocab[token] for token in word]
    return ids


def byte_chars() -> list[str]:
    """The character GPT-2 writes each byte as: printable Latin-1 ones as themselves, the
    others shifted to U+0100 and up, in order."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def gpt2_decode(ids, vocab: dict) -> str:
    """GPT-2's decoding: the tokens' bytes, a character cut short becoming U+FFFD."""
    token, byte = {i: t for t, i in vocab.items()}, {c: b for b, c in enumerate(byte_chars())}
    return bytes(byte[c] for i in ids for c in token[i]).decode("utf-8", errors="replace")


def read_files(vocab_path, merges_path):
    with open(vocab_path, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merges_path, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
    return vocab, merges


def test_ids_equal_transformers_and_gpt2s_algorithm(gpt2):
    from transformers import GPT2Tokenizer, GPT2TokenizerFast
    directory, vocab_path, merges_path = gpt2
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_path, merge_file=merges_path)
    vocab, merges = read_files(vocab_path, merges_path)
    texts = TEXTS + shakespeare(14)[12:]  # unseen scenes too
    for cls in {GPT2Tokenizer, GPT2TokenizerFast}:  # one class in transformers 5
        # split_special_tokens: as in Megatron-LM, "<|endoftext|>" in text is text.
        theirs = cls.from_pretrained(directory, local_files_only=True,
                                     split_special_tokens=True)
        assert ours.vocab_size == len(theirs) == len(vocab) == 500
        assert ours.eod == theirs.eos_token_id == vocab[GPT2_EOD] == 499
        for text in texts:
            ids = ours.tokenize(text)
            assert ids == theirs(text).input_ids == gpt2_encode(text, vocab, merges), text
            assert ours.detokenize(ids) == text == theirs.decode(ids)
    # What Megatron-LM's GPT-2 tokenizer does with the text "<|endoftext|>": characters,
    # never the end-of-document id, unlike transformers' default (a special token).
    assert ours.eod not in ours.tokenize("a<|endoftext|>b")
    assert ours.eod in GPT2Tokenizer.from_pretrained(directory)("a<|endoftext|>b").input_ids
    assert ours.detokenize([ours.eod]) == GPT2_EOD


def test_detokenize_takes_any_ints_and_replaces_cut_characters(gpt2):
    ours, (vocab, _) = GPT2BPETokenizer(*gpt2[1:]), read_files(*gpt2[1:])
    text = "\U0001f98a\U0001f600 t\u00e9st"  # a character the corpus lacks: byte tokens
    ids = ours.tokenize(text)
    assert ours.detokenize(np.array(ids, dtype=np.uint16)) == text
    cut = [ours.detokenize(ids[:k]) for k in range(len(ids))]
    assert cut == [gpt2_decode(ids[:k], vocab) for k in range(len(ids))]
    assert "\ufffd" in cut[1]


@pytest.fixture(scope="module")
def dataset(gpt2, tmp_path_factory):
    """tools/preprocess_data.py (in this process) on a small jsonl: (prefix, documents)."""
    directory = tmp_path_factory.mktemp("data")
    documents = shakespeare(20, 2000) + [t for t in TEXTS if t]
    flags = [*GPT2_FLAGS, gpt2[1], "--merge-file", gpt2[2]]
    return preprocess_texts(directory, "gpt2", documents, flags), documents


def test_preprocess_data_writes_the_tokenizers_ids(gpt2, dataset):
    prefix, documents = dataset
    ours, data = GPT2BPETokenizer(*gpt2[1:]), IndexedDataset(prefix)
    assert len(data) == len(documents) and data.dtype == np.uint16
    for i, text in enumerate(documents):
        assert data.get(i).tolist() == ours.tokenize(text) + [ours.eod]


def test_pretrain_trains_samples_and_checkpoints(gpt2, dataset, tmp_path, capfd):
    """Two iterations, an evaluation and a sample; the checkpoint copies both files and
    records them; a run with other merges cannot load it; the converter exports GPT-2's
    tokenizer files from it and imports them back."""
    from megaulysses.training.checkpoint import tokenizer_sha256
    directory, vocab, merges = gpt2
    save = tmp_path / "ckpt"
    tokenizer = GPT2_FLAGS + [vocab, "--merge-file", merges]
    gpt2_model = ["--position-embedding-type", "learned_absolute", "--normalization",
                  "LayerNorm", "--no-swiglu", "--add-bias-linear", "--num-query-groups", "4",
                  "--hidden-dropout", "0", "--attention-dropout", "0"]
    records = run_inprocess(tokenizer + gpt2_model + [
        "--data-path", dataset[0], "--split", "80,20,0", "--train-iters", "2",
        "--eval-interval", "2", "--generate", "8", "--save", str(save), "--save-interval",
        "2"], tmp_path)
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2]
    assert [r["iteration"] for r in records if "eval_loss" in r] == [2]
    assert re.search(r"---- sample from the trained model ----\n.*\n-+\n",
                     capfd.readouterr().out, re.S)
    iteration = save / "iter_0000002"
    for name, source in (("vocab.json", vocab), ("merges.txt", merges)):
        assert (iteration / name).read_bytes() == open(source, "rb").read()
    assert not (iteration / "tokenizer.model").exists()
    meta = json.loads((iteration / "trainer_state.json").read_text())["tokenizer"]
    assert meta["type"] == "GPT2BPETokenizer" and meta["vocab_size"] == 500
    assert meta["sha256"] == tokenizer_sha256(vocab, merges)

    # Same vocabulary size, one merge fewer: another tokenizer, refused at --load.
    fewer = tmp_path / "fewer_merges.txt"
    fewer.write_text("".join(open(merges, encoding="utf-8").readlines()[:-1]),
                     encoding="utf-8")
    import pretrain_gpt
    capfd.readouterr()
    argv = TINY + GPT2_FLAGS + [vocab, "--merge-file", str(fewer)] + gpt2_model + [
        "--data-path", dataset[0], "--split", "80,20,0", "--load", str(save),
        "--train-iters", "3",
        "--data-cache-path", str(tmp_path / "cache")]
    assert pretrain_gpt.main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another tokenizer than --vocab-file" in err[0], err

    check_converter_carries_the_tokenizer(str(save), tmp_path, vocab, merges)


def check_converter_carries_the_tokenizer(save, tmp_path, vocab, merges):
    from transformers import AutoTokenizer
    convert = load_tool("convert_checkpoint")

    def run(*args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = convert.main([str(a) for a in args])
        assert rc == 0 and err.getvalue() == "", err.getvalue()
        return out.getvalue()

    hf = tmp_path / "hf"
    run("to-hf", "--load", save, "--hf-dir", hf)
    theirs, ours = AutoTokenizer.from_pretrained(str(hf)), GPT2BPETokenizer(vocab, merges)
    text = TEXTS[11] + " a<|endoftext|>b"
    assert theirs(text).input_ids == ours.tokenize(text)
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == ours.eod
    out = run("from-hf", "--hf-dir", hf, "--save", tmp_path / "back")
    inside = tmp_path / "back" / "iter_0000000"
    assert (f"--tokenizer-type GPT2BPETokenizer --vocab-file {inside / 'vocab.json'} "
            f"--merge-file {inside / 'merges.txt'}") in out
    assert (inside / "merges.txt").read_bytes() == open(merges, "rb").read()
    assert GPT2BPETokenizer(str(inside / "vocab.json"), str(inside / "merges.txt")).tokenize(
        text) == ours.tokenize(text)


# -- bad files: one error naming the flag ---------------------------------------------------

def bad_vocab(vocab: dict) -> list:
    """(name, contents of vocab.json, words of the error): each breaks one rule."""
    holes = dict(vocab)
    holes.pop("\u0120")  # the byte symbol of " "
    no_eod = {t: i for t, i in vocab.items() if t != GPT2_EOD}
    shifted = {t: i + 1 for t, i in vocab.items()}
    return [("not-json", "{oops", "is not a GPT-2 vocab.json"),
            ("a-list", json.dumps(list(vocab)), "a JSON object of token -> integer id"),
            ("ids-past-count", json.dumps(shifted), "the ids must be 0..499, each once"),
            ("byte-missing", json.dumps(dict(zip(holes, range(len(holes)), strict=True))),
             "1 of the 256 byte symbols are missing"),
            ("no-endoftext", json.dumps(no_eod), f"has no {GPT2_EOD} token")]


def bad_merges(merges_text: str) -> list:
    header, first, *rest = merges_text.split("\n")
    return [("no-header", "\n".join([first, *rest]), "does not start with"),
            ("three-tokens", "\n".join([header, first + " x", *rest]), ":2: expected two tokens"),
            ("unknown-token", "\n".join([header, "\u0120zz\u00e9 q", *rest]),
             ":2: '\u0120zz\u00e9' is not in the --vocab-file")]


def test_bad_files_name_their_flag(gpt2, tmp_path):
    _, vocab_path, merges_path = gpt2
    vocab = json.load(open(vocab_path, encoding="utf-8"))
    merges_text = open(merges_path, encoding="utf-8").read()
    cases = [("--vocab-file", name, text, words) for name, text, words in bad_vocab(vocab)]
    cases += [("--merge-file", name, text, words) for name, text, words in bad_merges(
        merges_text)]
    for flag, name, text, words in cases:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        files = {"--vocab-file": vocab_path, "--merge-file": merges_path, flag: str(path)}
        with pytest.raises(ValueError) as e:
            GPT2BPETokenizer(files["--vocab-file"], files["--merge-file"])
        assert str(e.value).startswith(f"{flag}: ") and words in str(e.value), (name, e.value)
    with pytest.raises(ValueError, match="^--merge-file: required for GPT2BPETokenizer"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_path)
    with pytest.raises(FileNotFoundError, match="^--vocab-file: file not found"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "none.json"),
                        merge_file=merges_path)


def test_bad_files_stop_the_tools_with_one_line(gpt2, tmp_path, capfd):
    """pretrain_gpt.py (--dry-run opens the tokenizer too) and preprocess_data.py."""
    import pretrain_gpt
    _, vocab, merges = gpt2
    broken = tmp_path / "merges.txt"
    broken.write_text("a b c\n", encoding="utf-8")
    capfd.readouterr()
    assert pretrain_gpt.main(TINY + ["--mock-data", "--dry-run"] + GPT2_FLAGS + [
        vocab, "--merge-file", str(broken)]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: --merge-file: ") and "#version" in err and \
        err.count("\n") == 1, err
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hi"}\n')
    preprocess = load_tool("preprocess_data")
    assert preprocess.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                            "--tokenizer-type", "GPT2BPETokenizer", "--merge-file",
                            merges]) == 2
    err = capfd.readouterr().err
    assert err == "preprocess_data.py: error: --vocab-file: required for GPT2BPETokenizer\n"
