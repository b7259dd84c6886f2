"""HuggingFaceTokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model
DIR_OR_tokenizer.json, Megatron-LM's name) on byte-level BPE tokenizers trained here with
`tokenizers` and laid out as the Hub has them: a Llama 3 style one (bos added by a
TemplateProcessing post-processor, eos <|end_of_text|> not the last id, as 128001 of
128256) and a Qwen style one (eos named in special_tokens_map.json only, no bos). Its ids
equal transformers' (with and without special tokens), the eos is the end-of-document id
unless --eod-token-id, tools/preprocess_data.py writes its ids, pretrain_gpt.py trains,
samples, checkpoints the tokenizer files and resumes from them, and bad files or ids stop
both tools with one line. Nothing is downloaded."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from helpers import TINY, preprocess_texts, run_inprocess
from megaulysses.data.hf_tokenizer import HuggingFaceTokenizer
from megaulysses.data.indexed import IndexedDataset
from megaulysses.data.tokenizer import build_tokenizer
from test_gpt2_bpe import TEXTS, load_tool, shakespeare

# Llama 3's special tokens, in its order; three reserved ones make eos not the last id.
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>", "<|eot_id|>"]
HF = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
LLAMA3_TEXTS = TEXTS + ["<|begin_of_text|>Hi<|eot_id|>", "a <|end_of_text|> b<|eot_id|>\n"]


def train_bpe(n_scenes: int, vocab_size: int):
    """A byte-level BPE (GPT-2's pre-tokenizer, as Llama 3's and Qwen's are) trained on a
    few scenes of the bundled corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(shakespeare(n_scenes), trainer)
    return tok


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A directory as Llama 3's repository has it: tokenizer.json (bos added by its
    post-processor), tokenizer_config.json (eos as a token dict, as the Hub writes it) and
    special_tokens_map.json."""
    from tokenizers import AddedToken, processors
    directory = tmp_path_factory.mktemp("llama3")
    tok = train_bpe(10, 295)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[0]} $A", pair=f"{SPECIALS[0]} $A {SPECIALS[0]} $B",
        special_tokens=[(SPECIALS[0], bos)])
    tok.save(str(directory / "tokenizer.json"))
    eos = {"content": SPECIALS[1], "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False, "special": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIALS[0], "eos_token": eos, "model_max_length": 1024,
         "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1]}))
    return directory


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Qwen's layout: no bos ("bos_token": null, whatever config.json says), no
    post-processor, eos <|endoftext|> (the first added token), named here by
    special_tokens_map.json alone."""
    from tokenizers import AddedToken
    directory = tmp_path_factory.mktemp("qwen")
    tok = train_bpe(6, 280)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>"}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 281,
                                                       "eos_token_id": 282}))
    return directory


def test_ids_equal_transformers(llama3, qwen):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    texts = LLAMA3_TEXTS + shakespeare(12)[10:]  # unseen scenes too
    for directory in (llama3, qwen):
        plain = HuggingFaceTokenizer(str(directory))
        special = build_tokenizer("HuggingFaceTokenizer", str(directory),
                                  include_special_tokens=True)
        auto = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        fast = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
        assert plain.vocab_size == special.vocab_size == len(auto) == len(fast)
        assert plain.eod == plain.eos == auto.eos_token_id and plain.bos == auto.bos_token_id
        for text in texts:
            ids = plain.tokenize(text)
            assert ids == auto(text, add_special_tokens=False).input_ids == \
                fast.encode(text, add_special_tokens=False), text
            assert special.tokenize(text) == auto(text).input_ids == fast.encode(text), text
            assert plain.detokenize(np.array(ids, dtype=np.uint16)) == text == \
                auto.decode(ids)
    ours = HuggingFaceTokenizer(str(llama3))
    # As Llama 3's: eos is an added token before the last, bos starts every document
    # under --tokenizer-hf-include-special-tokens, and special tokens in text are tokens.
    assert (ours.vocab_size, ours.bos, ours.eod) == (300, 295, 296)
    assert build_tokenizer(*HF[1::2], str(llama3), include_special_tokens=True).tokenize(
        "") == [ours.bos]
    assert ours.tokenize("x<|eot_id|>") == ours.tokenize("x") + [299]
    assert HuggingFaceTokenizer(str(qwen)).eod == 280 and HuggingFaceTokenizer(str(qwen)).bos \
        is None


def test_eod_and_files(llama3, tmp_path):
    """--eod-token-id overrides the eos; a lone tokenizer.json names none; the files a
    checkpoint stores; generation_config.json's eos where no tokenizer file names one."""
    d = str(llama3)
    assert HuggingFaceTokenizer(d, eod_token_id=299).eod == 299
    assert sorted(HuggingFaceTokenizer(d).files) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    lone = str(llama3 / "tokenizer.json")
    with pytest.raises(ValueError, match="^--tokenizer-model: .* names no eos token .* "
                                         "--eod-token-id$"):
        HuggingFaceTokenizer(lone)
    ours = HuggingFaceTokenizer(lone, eod_token_id=0)
    assert (ours.eod, ours.bos, ours.files) == (0, None, {"tokenizer.json": lone})
    shutil.copy(lone, tmp_path / "tokenizer.json")
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 295, "eos_token_id": [296, 299]}))  # Llama 3.1's list
    ours = HuggingFaceTokenizer(str(tmp_path))
    assert (ours.eod, ours.bos) == (296, 295)
    assert list(ours.files) == ["tokenizer.json"]


def bad_cases(llama3, tmp: str) -> list:
    """(--tokenizer-model, extra flags, the flag the error names, words of the rule)."""
    os.makedirs(f"{tmp}/empty")
    os.makedirs(f"{tmp}/llama2")  # a SentencePiece-only repository
    open(f"{tmp}/llama2/tokenizer.model", "wb").close()
    with open(f"{tmp}/afile.json", "w") as f:
        f.write('{"version": "1.0", "model": 7}')
    shutil.copytree(llama3, f"{tmp}/wrong_eos")
    with open(f"{tmp}/wrong_eos/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    return [(f"{tmp}/none", [], "--tokenizer-model", f"file not found: {tmp}/none"),
            (f"{tmp}/empty", [], "--tokenizer-model", f"file not found: {tmp}/empty/"
             "tokenizer.json"),
            (f"{tmp}/llama2", [], "--tokenizer-model", "tokenizer.model is there: "
             "--tokenizer-type SentencePieceTokenizer reads it"),
            (f"{tmp}/afile.json", [], "--tokenizer-model",
             "afile.json is not a Hugging Face tokenizer.json"),
            (str(llama3), ["--eod-token-id", "300"], "--eod-token-id",
             "300 is outside the vocabulary"),
            (f"{llama3}/tokenizer.json", [], "--tokenizer-model", "give the end-of-document "
             "id with --eod-token-id"),
            (f"{tmp}/wrong_eos", [], "--tokenizer-model",
             "tokenizer_config.json: eos_token '</s>' is not in the vocabulary")]


def test_bad_input_stops_both_tools_with_one_line(llama3, tmp_path, capfd):
    """pretrain_gpt.py (--dry-run opens the tokenizer too) and preprocess_data.py."""
    import pretrain_gpt
    preprocess = load_tool("preprocess_data")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hi"}\n')
    for model, extra, flag, words in bad_cases(llama3, str(tmp_path)):
        capfd.readouterr()
        assert pretrain_gpt.main(TINY + ["--mock-data", "--dry-run"] + HF + [model] +
                                 extra) == 2, (model, extra)
        err = capfd.readouterr().err
        assert err.startswith(f"error: {flag}: ") and words in err and \
            err.count("\n") == 1, err
        assert preprocess.main(["--input", str(corpus), "--output-prefix",
                                str(tmp_path / "o"), *HF, model, *extra]) == 2
        err = capfd.readouterr().err
        assert err.startswith(f"preprocess_data.py: error: {flag}: ") and words in err and \
            err.count("\n") == 1, err
    assert not list(tmp_path.glob("o*"))  # nothing written


@pytest.fixture(scope="module")
def dataset(llama3, tmp_path_factory):
    """tools/preprocess_data.py on a small jsonl, with Llama 3's bos and the eos appended:
    (prefix, documents)."""
    directory = tmp_path_factory.mktemp("data")
    documents = shakespeare(16, 1500) + [t for t in LLAMA3_TEXTS if t]
    flags = [*HF, str(llama3), "--tokenizer-hf-include-special-tokens"]
    return preprocess_texts(directory, "l3", documents, flags), documents


def test_preprocess_data_writes_the_tokenizers_ids(llama3, dataset):
    prefix, documents = dataset
    ours, data = HuggingFaceTokenizer(str(llama3)), IndexedDataset(prefix)
    assert len(data) == len(documents) and data.dtype == np.uint16
    for i, text in enumerate(documents):
        assert data.get(i).tolist() == [ours.bos] + ours.tokenize(text) + [ours.eod]


def test_pretrain_trains_samples_checkpoints_and_resumes(llama3, dataset, tmp_path, capfd):
    """Two iterations, an evaluation and a sample; the checkpoint holds the tokenizer files
    and records tokenizer.json's sha256; a run resumes with the checkpoint itself as
    --tokenizer-model; another tokenizer.json of the same size cannot load it."""
    from megaulysses.training.checkpoint import tokenizer_sha256
    save, data = tmp_path / "ckpt", ["--data-path", dataset[0], "--split", "80,20,0"]
    records = run_inprocess(HF + [str(llama3), "--tokenizer-hf-include-special-tokens"] +
                            data + ["--train-iters", "2", "--eval-interval", "2",
                                    "--generate", "6", "--save", str(save),
                                    "--save-interval", "2"], tmp_path)
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2]
    assert [r["iteration"] for r in records if "eval_loss" in r] == [2]
    assert re.search(r"---- sample from the trained model ----\n.*\n-+\n",
                     capfd.readouterr().out, re.S)
    iteration = save / "iter_0000002"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (iteration / name).read_bytes() == (llama3 / name).read_bytes()
    assert not (iteration / "tokenizer.model").exists()
    meta = json.loads((iteration / "trainer_state.json").read_text())["tokenizer"]
    assert meta["type"] == "HuggingFaceTokenizer" and meta["vocab_size"] == 300
    assert meta["sha256"] == tokenizer_sha256(str(llama3 / "tokenizer.json"))

    records = run_inprocess(HF + [str(iteration)] + data + [
        "--load", str(save), "--train-iters", "3", "--eval-interval", "3"], tmp_path, "resume")
    assert [r["iteration"] for r in records if "loss" in r] == [3]

    # One merge fewer: the same 300 ids, another tokenizer, refused at --load.
    other = tmp_path / "other"
    shutil.copytree(llama3, other)
    spec = json.loads((other / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (other / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    import pretrain_gpt
    capfd.readouterr()
    assert pretrain_gpt.main(TINY + HF + [str(other)] + data + [
        "--load", str(save), "--train-iters", "3",
        "--data-cache-path", str(tmp_path / "cache")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"another tokenizer than --tokenizer-model {other}" in err[0], err
