"""tools/convert_checkpoint.py: our checkpoints <-> Hugging Face transformers.

Source checkpoints are trained by our trainer (2 steps of the tiny model, one fixture per
style, reused by every test of the module). Exports are loaded with transformers and must
give our model's logits within LOGITS_ATOL (fp32 both sides; the only differences are
rotary tables computed in fp64 vs fp32 and summation order). Imports of Hugging Face
models created with transformers must round-trip bit for bit, and load into the trainer.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from dist import run_ranks
from helpers import REPO, TINY, load_tool, read_jsonl, run_main

LOGITS_ATOL = 1e-4  # fp32 export vs our model, max abs difference over all logits
TOKENIZER_MODEL = os.path.join(REPO, "data", "shakespeare_tok.model")
CORPUS = os.path.join(REPO, "data", "shakespeare.jsonl")
# A short run: 2 steps of one micro-batch, no evaluation, a committed checkpoint at the end.
SOURCE_RUN = ["--train-iters", "2", "--eval-iters", "0", "--global-batch-size", "2"]
GPT2_STYLE = ["--num-query-groups", "4", "--position-embedding-type", "learned_absolute",
              "--normalization", "LayerNorm", "--no-swiglu", "--add-bias-linear"]


convert = load_tool("convert_checkpoint")


def run_convert(*args) -> tuple:
    """main() in this process: (exit code, stdout, stderr)."""
    return run_main(convert, *args)


def export(load, hf_dir, *flags) -> str:
    rc, out, err = run_convert("to-hf", "--load", load, "--hf-dir", hf_dir, *flags)
    assert rc == 0, err
    return err


def main_rc(rank, world, args):
    import pretrain_gpt
    return pretrain_gpt.main(args)


# -- source checkpoints, trained by our trainer ----------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


def train(workdir, name, flags) -> str:
    import pretrain_gpt
    save = str(workdir / name)
    rc = pretrain_gpt.main(TINY + SOURCE_RUN + list(flags) + [
        "--save", save, "--data-cache-path", str(workdir / "cache")])
    assert rc == 0
    return save


@pytest.fixture(scope="module")
def llama_ckpt(workdir):
    """TINY: Llama-style, GQA (4 heads, 2 kv heads), tied embeddings."""
    return train(workdir, "llama", [])


@pytest.fixture(scope="module")
def untied_ckpt(workdir):
    return train(workdir, "untied", ["--untie-embeddings-and-output-weights"])


@pytest.fixture(scope="module")
def rotary_ckpt(workdir):
    return train(workdir, "rotary", ["--rotary-base", "500000"])


@pytest.fixture(scope="module")
def gpt2_ckpt(workdir):
    return train(workdir, "gpt2", GPT2_STYLE)


@pytest.fixture(scope="module")
def tp2_ckpt(workdir):
    save = str(workdir / "tp2")
    args = TINY + SOURCE_RUN + ["--tensor-model-parallel-size", "2", "--save", save,
                                "--data-cache-path", str(workdir / "cache")]
    assert run_ranks(main_rc, 2, args) == [0, 0]
    return save


# -- ours -> Hugging Face: same logits ---------------------------------------------------------

def sample_tokens(n: int) -> torch.Tensor:
    """[2, n] token ids of real text: the first scenes of the corpus."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER_MODEL)
    with open(CORPUS) as f:
        docs = [json.loads(next(f))["text"] for _ in range(2)]
    return torch.tensor([sp.encode(d)[:n] for d in docs])


def assert_same_logits(load, hf_dir, arch_class):
    from transformers import AutoModelForCausalLM
    from megaulysses.model.attention import sdpa_attention
    from megaulysses.model.gpt import build_model
    from megaulysses.training.checkpoint import model_config, read_model_checkpoint
    meta, state = read_model_checkpoint(load)
    cfg = model_config(meta["model"])
    ours = build_model(cfg, sdpa_attention, seed=0)
    ours.load_state_dict(state)
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert type(theirs).__name__ == arch_class and theirs.dtype == torch.float32
    tokens = sample_tokens(cfg.seq_length) % cfg.vocab_size  # NullTokenizer runs: 501
    with torch.no_grad():
        want, got = ours.eval()(tokens), theirs.eval()(tokens).logits
    assert got.shape == want.shape == (2, cfg.seq_length, cfg.padded_vocab_size)
    assert (got - want).abs().max().item() <= LOGITS_ATOL
    return cfg, theirs.config


def test_llama_gqa_export_gives_our_logits(llama_ckpt, tmp_path):
    hf_dir = tmp_path / "hf"
    assert export(llama_ckpt, hf_dir) == ""  # no warnings: the run had a tokenizer
    cfg, config = assert_same_logits(llama_ckpt, hf_dir, "LlamaForCausalLM")
    assert (config.num_key_value_heads, config.num_attention_heads) == (2, 4)
    assert config.tie_word_embeddings and config.vocab_size == cfg.padded_vocab_size
    with open(hf_dir / "config.json") as f:
        written = json.load(f)
    assert written["dtype"] == written["torch_dtype"] == "float32"
    with open(hf_dir / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == 2  # the end-of-document token
    assert sorted(os.listdir(hf_dir)) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer.model", "tokenizer_config.json"]


def test_untied_export(untied_ckpt, tmp_path):
    from safetensors.torch import load_file
    export(untied_ckpt, tmp_path / "hf")
    _, config = assert_same_logits(untied_ckpt, tmp_path / "hf", "LlamaForCausalLM")
    assert not config.tie_word_embeddings
    assert "lm_head.weight" in load_file(tmp_path / "hf" / "model.safetensors")


def test_rotary_base_export(rotary_ckpt, tmp_path):
    export(rotary_ckpt, tmp_path / "hf")
    _, config = assert_same_logits(rotary_ckpt, tmp_path / "hf", "LlamaForCausalLM")
    assert config.rope_parameters["rope_theta"] == 500000.0


def test_tp2_checkpoint_export(tp2_ckpt, tmp_path):
    """A checkpoint saved by 2 tensor-parallel ranks, named by its iter_ directory."""
    export(os.path.join(tp2_ckpt, "iter_0000002"), tmp_path / "hf")
    assert_same_logits(tp2_ckpt, tmp_path / "hf", "LlamaForCausalLM")


def test_gpt2_style_export(gpt2_ckpt, tmp_path):
    export(gpt2_ckpt, tmp_path / "hf")
    _, config = assert_same_logits(gpt2_ckpt, tmp_path / "hf", "GPT2LMHeadModel")
    assert config.activation_function == "gelu_new" and config.n_positions == 32


def test_null_tokenizer_run_exports_without_tokenizer(workdir, tmp_path):
    """A NullTokenizer run (mock data): a warning, no tokenizer files, and generation stops
    at its eod, the id after the given vocabulary."""
    ckpt = train(workdir, "null", ["--mock-data", "--tokenizer-type", "NullTokenizer",
                                   "--vocab-size", "500"])
    warning = export(ckpt, tmp_path / "hf")
    assert warning.count("\n") == 1 and warning.startswith("warning: ")
    assert "NullTokenizer" in warning and "without tokenizer files" in warning
    assert not any(name.startswith("tokenizer") for name in os.listdir(tmp_path / "hf"))
    with open(tmp_path / "hf" / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == 500
    cfg, config = assert_same_logits(ckpt, tmp_path / "hf", "LlamaForCausalLM")
    assert (cfg.vocab_size, config.vocab_size) == (501, 512)  # padded rows are kept


def test_bf16_export_holds_the_rounded_weights(llama_ckpt, tmp_path):
    from safetensors.torch import load_file
    from megaulysses.training.checkpoint import read_model_checkpoint
    export(llama_ckpt, tmp_path / "hf", "--dtype", "bfloat16")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    _, state = read_model_checkpoint(llama_ckpt)
    got = weights["model.layers.1.self_attn.k_proj.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, state["layers.1.attn.k.weight"].to(torch.bfloat16))
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"


# -- the tokenizer -------------------------------------------------------------------------------

def corpus_texts(first: int, count: int) -> list:
    with open(CORPUS) as f:
        lines = f.readlines()[first:first + count]
    return [json.loads(line)["text"] for line in lines]


def test_exported_tokenizer_encodes_like_sentencepiece(llama_ckpt, tmp_path):
    import sentencepiece as spm
    from transformers import AutoTokenizer
    export(llama_ckpt, tmp_path / "hf")
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER_MODEL)
    texts = corpus_texts(0, 8) + ["  two spaces, a tab\tand 1603\n", "caf\u00e9 \u2603 <s>", ""]
    for text in texts:
        want = sp.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == want
        assert theirs(text)["input_ids"] == want  # no bos/eos added: we train without them
        assert theirs.decode(want) == text
    assert (theirs.bos_token_id, theirs.eos_token_id, len(theirs)) == (1, 2, 4096)


def test_unigram_tokenizer(tmp_path):
    """A unigram SentencePiece model (tools/train_tokenizer.py --model-type unigram)."""
    import sentencepiece as spm
    train_tokenizer = load_tool("train_tokenizer")
    corpus = tmp_path / "small.jsonl"
    with open(CORPUS) as src, open(corpus, "w") as dst:
        dst.writelines(next(src) for _ in range(30))
    path = train_tokenizer.train_tokenizer([str(corpus)], str(tmp_path / "uni"), 500, "unigram")
    theirs, sp = convert.hf_tokenizer(path), spm.SentencePieceProcessor(model_file=path)
    for text in corpus_texts(100, 5):  # unseen text: byte fallback for rare characters
        assert theirs.encode(text).ids == sp.encode(text)


# -- Hugging Face -> ours -> Hugging Face ------------------------------------------------------

def hf_llama(path, with_tokenizer=True):
    """A small random LlamaForCausalLM (GQA, untied, rope_theta 20000), saved."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, rope_theta=20000.0,
                         initializer_range=0.05, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    if with_tokenizer:  # a Llama repository ships its SentencePiece model
        shutil.copyfile(TOKENIZER_MODEL, os.path.join(path, "tokenizer.model"))
    return model


def hf_gpt2(path):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=48,
                        bos_token_id=299, eos_token_id=299)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(path)
    return model


# Not carried through our checkpoint: training settings of the source model (the export
# writes the training run's --hidden-dropout, --attention-dropout, --init-method-std when
# the checkpoint records them, else 0, 0, 0.02), where it was loaded from, the version
# stamp. n_inner=None means 4 * n_embd, which the export writes explicitly.
NOT_CARRIED = {"resid_pdrop", "embd_pdrop", "attn_pdrop", "initializer_range",
               "_name_or_path", "transformers_version", "n_inner"}


def assert_round_trip(src, dst):
    from safetensors.torch import load_file
    from transformers import AutoConfig
    a, b = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ca, cb = AutoConfig.from_pretrained(src).to_dict(), AutoConfig.from_pretrained(dst).to_dict()
    assert sorted(ca) == sorted(cb)
    assert {k: ca[k] for k in ca if k not in NOT_CARRIED} == {
        k: cb[k] for k in cb if k not in NOT_CARRIED}
    return ca, cb


def test_llama_round_trip_is_bit_identical(tmp_path):
    hf_llama(tmp_path / "hf")
    rc, out, err = run_convert("from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ours")
    assert rc == 0 and err == "", err
    assert os.path.exists(tmp_path / "ours" / "iter_0000000" / "tokenizer.model")
    assert export(tmp_path / "ours", tmp_path / "back") == ""
    assert_round_trip(tmp_path / "hf", tmp_path / "back")


def test_gpt2_round_trip_is_bit_identical(tmp_path):
    hf_gpt2(tmp_path / "hf")
    rc, out, err = run_convert("from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ours")
    assert rc == 0, err
    assert err.count("\n") == 1 and err.startswith("warning: ")  # no tokenizer.model
    assert "--tokenizer-type NullTokenizer --vocab-size 299" in out
    assert "--make-vocab-size-divisible-by 4" in out  # ceil(300 / 4) * 4 == 300
    warning = export(tmp_path / "ours", tmp_path / "back")
    assert warning.startswith("warning: ") and "without tokenizer files" in warning
    assert not os.path.exists(tmp_path / "back" / "tokenizer.json")
    ca, cb = assert_round_trip(tmp_path / "hf", tmp_path / "back")
    assert cb["n_inner"] == 4 * ca["n_embd"]


def test_sharded_and_bin_weights_import_alike(tmp_path):
    """model.safetensors, shards with an index, and a torch pytorch_model.bin."""
    from megaulysses.training.checkpoint import read_model_checkpoint
    model = hf_llama(tmp_path / "one", with_tokenizer=False)
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    assert os.path.exists(tmp_path / "shards" / "model.safetensors.index.json")
    (tmp_path / "bin").mkdir()
    shutil.copyfile(tmp_path / "one" / "config.json", tmp_path / "bin" / "config.json")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    states = []
    for name in ("one", "shards", "bin"):
        rc, _, err = run_convert("from-hf", "--hf-dir", tmp_path / name, "--save",
                                 tmp_path / f"ours_{name}")
        assert rc == 0, err
        states.append(read_model_checkpoint(str(tmp_path / f"ours_{name}"))[1])
    for state in states[1:]:
        assert sorted(state) == sorted(states[0])
        assert all(torch.equal(state[k], states[0][k]) for k in state)


def test_ours_to_hf_to_ours_is_bit_identical(llama_ckpt, tmp_path):
    """Same parameters, same model shape, same tokenizer (by sha256) as the trained run."""
    from megaulysses.training.checkpoint import read_model_checkpoint
    export(llama_ckpt, tmp_path / "hf")
    rc, _, err = run_convert("from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "back")
    assert rc == 0 and err == "", err
    (meta, state), (meta2, state2) = (read_model_checkpoint(str(p)) for p in
                                      (llama_ckpt, tmp_path / "back"))
    assert meta2["model"] == meta["model"] and meta2["contents"] == ["model"]
    assert meta2["tokenizer"]["sha256"] == meta["tokenizer"]["sha256"]
    assert sorted(state2) == sorted(state)
    assert all(torch.equal(state2[k], state[k]) for k in state)


def test_vocab_padding_rule():
    assert convert.divisible_by(4096, 4096) == 128
    assert convert.divisible_by(50257, 50304) == 128  # GPT-2's tokenizer, padded model
    assert convert.divisible_by(50257, 50257) == 1
    assert convert.divisible_by(32000, 32064) == 96  # no power of two fits
    for vocab, hf_vocab in ((300, 300), (4000, 4096), (32000, 32064), (7, 1000)):
        m = convert.divisible_by(vocab, hf_vocab)
        assert -(-vocab // m) * m == hf_vocab


# -- an import continues training --------------------------------------------------------------

def test_import_trains_from_the_hf_weights(tmp_path):
    """The printed flags run; iteration 1's loss is the HF model's loss on that batch, and
    with --lr 0 the saved parameters are exactly the imported ones."""
    import pretrain_gpt
    from megaulysses.config import parse_args
    from megaulysses.training.data import build_datasets
    from megaulysses.training.checkpoint import read_model_checkpoint
    model = hf_llama(tmp_path / "hf")
    rc, out, _ = run_convert("from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ours")
    assert rc == 0
    command = next(line for line in out.splitlines() if line.startswith("python pretrain_gpt.py"))
    flags = shlex.split(command)[2:]
    run = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
           "--eval-iters", "0", "--lr", "0", "--min-lr", "0", "--generate", "0",
           "--peak-tflops", "1", "--seed", "11", "--data-cache-path", str(tmp_path / "cache")]
    metrics = str(tmp_path / "metrics.jsonl")
    assert pretrain_gpt.main(flags + run + ["--metrics-jsonl", metrics,
                                            "--save", str(tmp_path / "after")]) == 0
    loss = next(r["loss"] for r in read_jsonl(metrics) if r.get("iteration") == 1)

    cfg = parse_args(flags + run)  # the same first global batch, read as the trainer does
    train_set = build_datasets(cfg, 4096)[0]
    batch = torch.from_numpy(np.stack([train_set[i] for i in range(4)]).astype(np.int64))
    with torch.no_grad():
        logits = model.eval()(batch[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 4096), batch[:, 1:].flatten())
    assert loss == pytest.approx(want.item(), rel=1e-5)
    _, imported = read_model_checkpoint(str(tmp_path / "ours"))
    _, after = read_model_checkpoint(str(tmp_path / "after"))
    assert all(torch.equal(imported[k], after[k]) for k in imported)


# -- bad input: one line, exit 2, nothing left behind ------------------------------------------

def assert_refused(tmp_path, args, where, *words):
    rc, out, err = run_convert(*args)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {where}: "), err
    for word in words:
        assert word in err, err
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp-" in n or n.startswith(".old-")]
    assert leftovers == [] and not os.path.exists(tmp_path / "out")


def test_missing_checkpoint(tmp_path):
    assert_refused(tmp_path, ["to-hf", "--load", tmp_path / "nope", "--hf-dir", tmp_path / "out"],
                   "--load", "does not exist")


def test_corrupt_checkpoint(llama_ckpt, tmp_path):
    shutil.copytree(llama_ckpt, tmp_path / "ckpt")
    with open(tmp_path / "ckpt" / "iter_0000002" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    assert_refused(tmp_path, ["to-hf", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out"],
                   "--load", "corrupt")


def test_bad_tokenizer_leaves_no_output(llama_ckpt, tmp_path):
    """Found after writing began: the staged directory goes away."""
    shutil.copytree(llama_ckpt, tmp_path / "ckpt")
    with open(tmp_path / "ckpt" / "iter_0000002" / "tokenizer.model", "wb") as f:
        f.write(b"not a model")
    assert_refused(tmp_path, ["to-hf", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out"],
                   os.path.join(tmp_path, "ckpt", "iter_0000002", "tokenizer.model"),
                   "SentencePiece")


def test_gqa_model_cannot_be_gpt2(llama_ckpt, tmp_path):
    assert_refused(tmp_path, ["to-hf", "--load", llama_ckpt, "--hf-dir", tmp_path / "out",
                              "--arch", "gpt2"], "--arch", "grouped-query attention")


def test_existing_output_needs_force(llama_ckpt, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    rc, _, err = run_convert("to-hf", "--load", llama_ckpt, "--hf-dir", tmp_path / "out")
    assert rc == 2 and err.startswith("error: --hf-dir: ") and "--force" in err
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    export(llama_ckpt, tmp_path / "out", "--force")
    assert "keep.txt" not in os.listdir(tmp_path / "out")


@pytest.mark.parametrize("make,key,value,words", [
    ("llama", "model_type", "gemma", ["model_type 'gemma' is not supported"]),
    ("llama", "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
     ["rope_parameters", "'dynamic' is not supported"]),
    ("llama", "hidden_act", "gelu", ["hidden_act", "silu"]),
    ("llama", "mlp_bias", True, ["mlp_bias", "attention_bias"]),
    ("gpt2", "activation_function", "relu", ["activation_function", "gelu_new"]),
])
def test_unsupported_hf_configs(tmp_path, make, key, value, words):
    hf = tmp_path / "hf"
    hf_llama(hf, with_tokenizer=False) if make == "llama" else hf_gpt2(hf)
    with open(hf / "config.json") as f:
        config = json.load(f)
    config[key] = value
    with open(hf / "config.json", "w") as f:
        json.dump(config, f)
    assert_refused(tmp_path, ["from-hf", "--hf-dir", hf, "--save", tmp_path / "out"],
                   os.path.join(hf, "config.json"), *words)


def test_hf_weights_that_do_not_fit(tmp_path):
    from safetensors.torch import load_file, save_file
    hf = tmp_path / "hf"
    hf_llama(hf, with_tokenizer=False)
    weights = load_file(hf / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 32)
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    assert_refused(tmp_path, ["from-hf", "--hf-dir", hf, "--save", tmp_path / "out"],
                   hf, "up_proj", "shape")


def test_unknown_direction_and_help_as_a_program(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    tool = os.path.join(REPO, "tools", "convert_checkpoint.py")
    bad = subprocess.run([sys.executable, tool, "sideways"], capture_output=True, text=True,
                         env=env)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: direction: ") and bad.stderr.count("\n") == 1
    text = subprocess.run([sys.executable, tool, "--help"], capture_output=True, text=True,
                          env=env, check=True).stdout
    for needle in ("to-hf --load", "from-hf --hf-dir", "c_attn", "rotate-half",
                   "NO permutation", "padded_vocab_size", "--make-vocab-size-divisible-by"):
        assert needle in text, needle
