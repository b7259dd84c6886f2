"""from-hf keeps what the model was made with: a Mistral-style sliding window comes back at
--load (refused without --window-size, brought back by --use-checkpoint-args), and a
GPT-2-style repository whose <|endoftext|> is an added token of tokenizer.json only (not in
vocab.json) is read through tokenizer.json. Tiny random models made by transformers here;
nothing downloaded."""

import json
import os
import shlex

import torch

import pretrain_gpt
from helpers import REPO, load_tool, run_main

convert = load_tool("convert_checkpoint")
CORPUS = os.path.join(REPO, "data", "shakespeare.jsonl")
RUN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters",
       "1", "--eval-iters", "0", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "0",
       "--generate", "0", "--peak-tflops", "1", "--hidden-dropout", "0",
       "--attention-dropout", "0"]


def from_hf(hf, out) -> list:
    """from-hf, in this process: the printed pretrain_gpt.py flags."""
    rc, stdout, err = run_main(convert, "from-hf", "--hf-dir", hf, "--save", out,
                               "--seq-length", "32")
    assert rc == 0, err
    line = next(x for x in stdout.splitlines() if x.startswith("python pretrain_gpt"))
    return shlex.split(line)[2:]


def without(flags: list, flag: str) -> list:
    i = flags.index(flag)
    return flags[:i] + flags[i + 2:]


def test_mistral_window_comes_back_at_load(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=8)).save_pretrained(tmp_path / "hf")
    flags = from_hf(tmp_path / "hf", tmp_path / "ours")
    assert flags[flags.index("--window-size") + 1] == "8"
    cache = ["--data-cache-path", str(tmp_path / "cache")]

    rc, _, err = run_main(pretrain_gpt, *without(flags, "--window-size"), *RUN, *cache)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --window-size: ") and "pass --window-size 8" in err, err

    for name, run in (("printed", flags),
                      ("ckargs", without(flags, "--window-size") + ["--use-checkpoint-args"])):
        save = tmp_path / name
        rc, _, err = run_main(pretrain_gpt, *run, *RUN, *cache, "--save", save)
        assert rc == 0, err
        with open(save / "iter_0000001" / "trainer_state.json") as f:
            assert json.load(f)["args"]["model"]["window_size"] == 8


def gpt2_repository(path) -> tuple:
    """GPT-2's files as some repositories have them: vocab.json and merges.txt from the BPE
    model alone, <|endoftext|> an added (special) token of tokenizer.json only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    with open(CORPUS) as f:
        texts = [json.loads(next(f))["text"] for _ in range(20)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|endoftext|>"])
    eod = tok.token_to_id("<|endoftext|>")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(path)
    tok.model.save(str(path))  # vocab.json, merges.txt: no <|endoftext|> in them
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                               bos_token_id=eod, eos_token_id=eod)).save_pretrained(path)
    return texts, eod


def test_gpt2_eod_only_in_tokenizer_json(tmp_path):
    from megaulysses.data.hf_tokenizer import HuggingFaceTokenizer
    from transformers import AutoTokenizer
    texts, eod = gpt2_repository(tmp_path / "hf")
    with open(tmp_path / "hf" / "vocab.json") as f:
        assert "<|endoftext|>" not in json.load(f)  # the case: GPT2BPETokenizer refuses it
    flags = from_hf(tmp_path / "hf", tmp_path / "ours")
    inside = tmp_path / "ours" / "iter_0000000"
    assert flags[flags.index("--tokenizer-type") + 1] == "HuggingFaceTokenizer"
    assert flags[flags.index("--tokenizer-model") + 1] == str(inside)
    ours = HuggingFaceTokenizer(str(inside))
    assert ours.eod == eod
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in texts[:5]:
        assert ours.tokenize(text) == theirs.encode(text, add_special_tokens=False)
    rc, _, err = run_main(pretrain_gpt, *flags, *RUN, "--data-cache-path", tmp_path / "cache")
    assert rc == 0, err
