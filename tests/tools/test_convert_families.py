"""tools/convert_checkpoint.py for every family and RoPE scaling, both ways.

Each case is a tiny random model made by transformers here (hidden 64, 2 layers, vocab
256, fp32; every parameter perturbed, so a swapped or dropped tensor shows), saved, then:
from-hf, our model's logits against transformers' (LOGITS_ATOL); to-hf of that import,
transformers' logits against ours and the tensors bit for bit against the source; then
2 steps of pretrain_gpt.py on --mock-data from the import, to-hf, and the logits again.
Logits are compared on 128 tokens at positions 0..127 and at 8064..8191 (the top of
"positions below 8K"), the latter also with transformers' own rotary cos and sin fed to
our model (LOGITS_ATOL says why); with the scaled ropes' original context at 64, the
tokens cross the frequencies where llama3 and yarn blend. The measured differences are
printed (pytest -s), a table at the end of the module.
"""

import dataclasses
import functools
import json
import os
import shlex
import shutil

import pytest
import torch

from helpers import REPO, load_tool, run_main

SEQ = 128
LATE = 8192 - SEQ  # positions LATE..8191: the top of "below 8K"
# Max abs difference over all logits (fp32), by span: positions 0..127 and 8064..8191.
# Both 1e-5: our rotary angles are transformers' fp32 angles (model/rope.py), so the error
# that fp32 angles have at late positions is the same on both sides.
LOGITS_ATOL = {"early": 1e-5, "late": 1e-5}
CORPUS = os.path.join(REPO, "data", "shakespeare.jsonl")


convert = load_tool("convert_checkpoint")


def run_convert(*args) -> tuple:
    """main() in this process: (exit code, stdout, stderr)."""
    return run_main(convert, *args)


def ok(*args) -> str:
    rc, out, err = run_convert(*args)
    assert rc == 0, err
    return out


# -- the cases: (transformers classes, config keys) ---------------------------------------------

ROPE_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 initializer_range=0.08)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}
CASES = {
    "llama": ("Llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
                            tie_word_embeddings=True)),
    "llama-linear": ("Llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                    "rope_theta": 10000.0})),
    "llama-llama3": ("Llama", dict(rope_parameters=LLAMA3, tie_word_embeddings=True)),
    "llama-yarn": ("Llama", dict(rope_parameters=YARN)),
    "llama-yarn-mscale": ("Llama", dict(rope_parameters={
        **YARN, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.5})),
    "llama-bias": ("Llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("Mistral", dict(sliding_window=16, head_dim=32)),
    "qwen2": ("Qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=0,
                            rope_parameters={**YARN, "rope_theta": 1e6},
                            tie_word_embeddings=True)),
    "qwen3": ("Qwen3", dict(head_dim=32, rope_parameters=LLAMA3)),
    "gpt2": ("GPT2", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ,
                          initializer_range=0.08, bos_token_id=255, eos_token_id=255)),
    # the exact GeLU: --no-bias-gelu-fusion (Megatron-LM's unfused GeLU)
    "gpt2-erf": ("GPT2", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ,
                              initializer_range=0.08, bos_token_id=255, eos_token_id=255,
                              activation_function="gelu")),
}
FAMILY = {"Llama": "LlamaForCausalLM", "Mistral": "MistralForCausalLM",
          "Qwen2": "Qwen2ForCausalLM", "Qwen3": "Qwen3ForCausalLM", "GPT2": "GPT2LMHeadModel"}
MEASURED = {}  # (case, direction) -> max abs logits difference, printed


def make_hf(name: str, path, dtype=torch.float32, **changes):
    """The case's model (`changes` to its config on top), its parameters perturbed (norms
    off 1, biases off 0), saved."""
    import transformers
    prefix, keys = CASES[name]
    config_class = getattr(transformers, prefix + "Config")
    model_class = getattr(transformers, FAMILY[prefix])
    torch.manual_seed(0)
    model = model_class(config_class(**{**({} if prefix == "GPT2" else ROPE_BASE), **keys,
                                        **changes}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.to(dtype).save_pretrained(path)
    return model


# -- comparing logits -------------------------------------------------------------------------

def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))


def ours_from(ckpt):
    """Our model from a checkpoint, with the window it was trained or imported with."""
    from megaulysses.model.attention import math_attention
    from megaulysses.model.gpt import build_model
    from megaulysses.training.checkpoint import model_config, read_model_checkpoint
    meta, state = read_model_checkpoint(str(ckpt))
    cfg = model_config(meta["model"])
    window = convert.run_mask(meta).get("window_size")
    model = build_model(dataclasses.replace(cfg, window_size=window), math_attention, seed=0)
    model.load_state_dict(state)
    return model.eval(), cfg


def logits_diff(ours, theirs, start: int) -> float:
    x, pos = tokens(), torch.arange(start, start + SEQ).expand(2, SEQ)
    with torch.no_grad():
        want, got = ours(x, position_ids=pos), theirs(x, position_ids=pos).logits
    assert got.shape == want.shape
    return (got - want).abs().max().item()


def max_diff(ours, theirs, cfg) -> dict:
    """{span: max abs difference} (the early span only for learned positions, which end
    at max_position_embeddings)."""
    diffs = {"early": logits_diff(ours, theirs, 0)}
    if cfg.position_embedding_type == "rope":
        diffs["late"] = logits_diff(ours, theirs, LATE)
    return diffs


def within(diffs: dict) -> bool:
    return all(d <= LOGITS_ATOL[span] for span, d in diffs.items())


def record(name: str, direction: str, diffs: dict):
    for span, diff in diffs.items():
        MEASURED[(name, direction, span)] = diff
        print(f"\nlogits max |difference| {name} {direction} {span}: {diff:.3g}")
    assert within(diffs), (name, direction, diffs)


# -- shared work: each case imported once ---------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@functools.lru_cache(maxsize=None)
def _imported(root: str, name: str) -> tuple:
    hf, ours = os.path.join(root, name, "hf"), os.path.join(root, name, "ours")
    make_hf(name, hf)
    out = ok("from-hf", "--hf-dir", hf, "--save", ours, "--seq-length", "64")
    command = next(line for line in out.splitlines() if line.startswith("python pretrain_gpt"))
    return hf, ours, shlex.split(command)[2:]


@pytest.fixture
def imported(workdir):
    return lambda name: _imported(str(workdir), name)


NOT_CARRIED = {"initializer_range", "_name_or_path", "transformers_version",
               "resid_pdrop", "embd_pdrop", "attn_pdrop", "n_inner"}


def assert_same_files(src, dst):
    """The export of an import: the same tensors bit for bit, the same config."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(
        os.path.join(dst, "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    ca, cb = (AutoConfig.from_pretrained(p).to_dict() for p in (src, dst))
    assert {k: v for k, v in ca.items() if k not in NOT_CARRIED} == {
        k: v for k, v in cb.items() if k not in NOT_CARRIED}


@pytest.mark.parametrize("name", CASES)
def test_both_directions_and_after_training(name, imported, workdir):
    import pretrain_gpt
    from transformers import AutoModelForCausalLM
    hf, ours_dir, flags = imported(name)
    source = AutoModelForCausalLM.from_pretrained(hf).eval()
    ours, cfg = ours_from(ours_dir)
    record(name, "from-hf", max_diff(ours, source, cfg))

    back = os.path.join(workdir, name, "back")
    ok("to-hf", "--load", ours_dir, "--hf-dir", back)
    theirs = AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(theirs).__name__ == type(source).__name__  # the recorded family
    record(name, "to-hf", max_diff(ours, theirs, cfg))
    assert_same_files(hf, back)

    trained = os.path.join(workdir, name, "trained")
    run = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
           "--train-iters", "2", "--eval-iters", "0", "--lr", "1e-3", "--min-lr", "1e-4",
           "--lr-warmup-iters", "0", "--generate", "0", "--peak-tflops", "1", "--seed", "5",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--save", trained,
           "--data-cache-path", os.path.join(workdir, "cache")]
    assert pretrain_gpt.main(flags + run) == 0
    after = os.path.join(workdir, name, "after")
    ok("to-hf", "--load", trained, "--hf-dir", after)  # the family from-hf recorded
    origin = [json.loads(open(os.path.join(d, "iter_%07d" % it, "trainer_state.json")).read())
              ["converted_from"] for d, it in ((ours_dir, 0), (trained, 2))]
    assert origin[0] == origin[1]  # the training run kept the import's origin
    ours2, _ = ours_from(trained)
    assert not torch.equal(ours2.embed.word.weight, ours.embed.word.weight)  # it trained
    theirs2 = AutoModelForCausalLM.from_pretrained(after).eval()
    assert type(theirs2).__name__ == type(source).__name__
    record(name, "after training, to-hf", max_diff(ours2, theirs2, cfg))


def test_window_definitions_are_the_same(imported, workdir):
    """Ours: i - W < j <= i; transformers' sliding_window W: kv > q - W. Equal logits at
    a sequence 8x the window (above), and W +- 1 on their side differs: the test sees
    an off-by-one."""
    from transformers import AutoModelForCausalLM
    hf, ours_dir, flags = imported("mistral")
    assert flags[flags.index("--window-size") + 1] == "16"
    ours, cfg = ours_from(ours_dir)
    for window in (15, 17):
        theirs = AutoModelForCausalLM.from_pretrained(hf, sliding_window=window).eval()
        assert max_diff(ours, theirs, cfg)["early"] > 1e-3


def test_printed_flags_carry_every_feature(imported):
    expect = {"llama-llama3": ["--use-rope-scaling", "--rope-scaling-factor", "8.0",
                               "--original-max-position-embeddings", "64"],
              "llama-linear": ["--rotary-seq-len-interpolation-factor", "4.0"],
              "llama-yarn-mscale": ["--rope-type", "yarn", "--yarn-beta-fast", "16.0",
                                    "--mscale", "0.8", "--mscale-all-dim", "0.5"],
              "qwen2": ["--add-qkv-bias", "--disable-bias-linear", "--window-size", "24"],
              "qwen3": ["--qk-layernorm", "--kv-channels", "32"],
              "gpt2-erf": ["--no-bias-gelu-fusion"]}
    for name, words in expect.items():
        flags = imported(name)[2]
        assert all(w in flags for w in words), (name, flags)
    assert "--no-bias-gelu-fusion" not in imported("gpt2")[2]  # gelu_new: the tanh GeLU


# -- export: shards, dtype, family choice ----------------------------------------------------------

def test_sharded_export_loads_and_imports_back(imported, tmp_path):
    from transformers import AutoModelForCausalLM
    from megaulysses.training.checkpoint import read_model_checkpoint
    hf, ours_dir, _ = imported("qwen3")
    out = ok("to-hf", "--load", ours_dir, "--hf-dir", tmp_path / "sharded",
             "--max-shard-size", "40KB")
    names = sorted(os.listdir(tmp_path / "sharded"))
    shards = [n for n in names if n.startswith("model-0")]
    assert len(shards) > 2 and "model.safetensors.index.json" in names, names
    assert "model.safetensors" not in names and f"{len(shards)} safetensors shards" in out
    with open(tmp_path / "sharded" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert sorted(set(index["weight_map"].values())) == shards
    for shard in shards:  # none over 40 kB (plus its header) unless one tensor alone is
        alone = list(index["weight_map"].values()).count(shard) == 1
        assert alone or os.path.getsize(tmp_path / "sharded" / shard) < 41_000
    ours, cfg = ours_from(ours_dir)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    assert within(max_diff(ours, theirs, cfg))
    ok("from-hf", "--hf-dir", tmp_path / "sharded", "--save", tmp_path / "again")
    (_, a), (_, b) = (read_model_checkpoint(str(p)) for p in (ours_dir, tmp_path / "again"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_source_dtype_is_kept_unless_asked(tmp_path):
    from safetensors.torch import load_file
    from megaulysses.training.checkpoint import read_model_checkpoint
    make_hf("qwen3", tmp_path / "hf", dtype=torch.bfloat16)
    out = ok("from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ours")
    assert "(bfloat16)" in out
    meta, _ = read_model_checkpoint(str(tmp_path / "ours"))
    assert meta["converted_from"]["dtype"] == "bfloat16"
    ok("to-hf", "--load", tmp_path / "ours", "--hf-dir", tmp_path / "back")
    src, back = (load_file(p / "model.safetensors") for p in (tmp_path / "hf", tmp_path / "back"))
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], src[k]) for k in src)
    with open(tmp_path / "back" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    ok("to-hf", "--load", tmp_path / "ours", "--hf-dir", tmp_path / "fp32", "--dtype", "float32")
    assert load_file(tmp_path / "fp32" / "model.safetensors")[
        "model.norm.weight"].dtype == torch.float32


def test_arch_can_be_forced_where_the_family_holds_the_model(imported, tmp_path):
    """A plain Llama import is also a Mistral (no window) and a Qwen2 can't be (biases)."""
    from transformers import AutoModelForCausalLM
    _, ours_dir, _ = imported("llama-llama3")
    ok("to-hf", "--load", ours_dir, "--hf-dir", tmp_path / "m", "--arch", "mistral")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(theirs).__name__ == "MistralForCausalLM" and theirs.config.sliding_window is None
    ours, cfg = ours_from(ours_dir)
    assert within(max_diff(ours, theirs, cfg))


def test_transformers_4_config_imports_alike(imported, tmp_path):
    """config.json as transformers 4 wrote it: rope_scaling {"type": ...} and a top-level
    rope_theta, no rope_parameters."""
    from megaulysses.training.checkpoint import read_model_checkpoint
    hf, ours_dir, _ = imported("llama-llama3")
    shutil.copytree(hf, tmp_path / "v4")
    config = json.loads((tmp_path / "v4" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (tmp_path / "v4" / "config.json").write_text(json.dumps(config))
    ok("from-hf", "--hf-dir", tmp_path / "v4", "--save", tmp_path / "ours", "--seq-length", "64")
    (a, _), (b, _) = (read_model_checkpoint(str(p)) for p in (ours_dir, tmp_path / "ours"))
    assert a["model"] == b["model"] and b["model"]["use_rope_scaling"]
    config["rope_scaling"]["type"] = "dynamic"
    (tmp_path / "v4" / "config.json").write_text(json.dumps(config))
    assert_refused(tmp_path, ["from-hf", "--hf-dir", tmp_path / "v4", "--save",
                              tmp_path / "out"], tmp_path / "v4" / "config.json",
                   "rope_scaling: rope_type 'dynamic' is not supported")


def test_auto_family():
    """--arch auto: the recorded family where it holds the model, else by features."""
    from helpers import llama_config
    plain, learned = llama_config(), llama_config(position_embedding_type="learned_absolute",
                                                  normalization="LayerNorm", swiglu=False,
                                                  add_bias_linear=True)
    qk, qkv = llama_config(qk_layernorm=True), llama_config(add_qkv_bias=True)
    window = {"window_size": 16}
    for cfg, mask, recorded, want in (
            (plain, {}, None, "llama"), (plain, {}, "mistral", "mistral"),
            (plain, window, None, "mistral"), (plain, window, "llama", "mistral"),
            (plain, window, "qwen2", "mistral"), (qkv, window, None, "qwen2"),
            (qk, window, "mistral", "qwen3"), (qkv, {}, "llama", "qwen2"),
            (learned, {}, None, "gpt2"), (learned, {}, "llama", "gpt2")):
        assert convert.pick_arch(cfg, "auto", mask, recorded) == want, (cfg, mask, recorded)
    with pytest.raises(convert.ConvertError, match="--attention-sparsity fixed: no Hugging"):
        convert.pick_arch(plain, "auto", {"attention_sparsity": "fixed"})


# -- tokenizers ----------------------------------------------------------------------------------

def save_bpe_tokenizer(path, size=300, eos_in_config=True):
    """A byte-level BPE trained on a little Shakespeare, saved as transformers saves it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    with open(CORPUS) as f:
        texts = [json.loads(next(f))["text"] for _ in range(20)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    special = dict(eos_token="<|endoftext|>", pad_token="<|pad|>") if eos_in_config else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(path)
    tok.model.save(str(path))  # vocab.json and merges.txt too, as Qwen's directories have
    return texts


def test_hf_tokenizer_round_trip_generates(tmp_path):
    """A Qwen2 directory with tokenizer.json (and vocab.json, merges.txt, which are not
    GPT-2's): the checkpoint stores tokenizer.json, and the export is a directory
    AutoTokenizer and AutoModelForCausalLM generate from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from megaulysses.data.hf_tokenizer import HuggingFaceTokenizer
    make_hf("qwen2", tmp_path / "hf", vocab_size=320)  # bigger than the tokenizer's 300
    texts = save_bpe_tokenizer(tmp_path / "hf")
    out = ok("from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ours")
    inside = tmp_path / "ours" / "iter_0000000"
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {inside}" in out
    assert "--eod-token-id" not in out  # tokenizer_config.json names the eos
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (inside / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    assert not (inside / "vocab.json").exists()
    ours = HuggingFaceTokenizer(str(inside))
    assert "--vocab-size" not in out and ours.vocab_size == 300 and ours.eod == 0
    ok("to-hf", "--load", tmp_path / "ours", "--hf-dir", tmp_path / "back")
    theirs = AutoTokenizer.from_pretrained(tmp_path / "back")
    for text in texts[:5] + ["  two spaces\tand caf\u00e9 <|endoftext|>"]:
        assert theirs.encode(text, add_special_tokens=False) == ours.tokenize(text)
    with open(tmp_path / "back" / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    prompt = theirs("First Citizen:", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] <= prompt["input_ids"].shape[1] + 5
    assert isinstance(theirs.decode(generated[0]), str)


def test_eos_outside_the_tokenizer_files(tmp_path):
    """tokenizer_config.json names no eos: generation_config.json's is passed on as
    --eod-token-id and written back; with none anywhere, from-hf's --eod-token-id."""
    from transformers import AutoTokenizer
    make_hf("llama", tmp_path / "hf", vocab_size=320)
    save_bpe_tokenizer(tmp_path / "hf", eos_in_config=False)

    def set_eos(eos):
        for name in ("config.json", "generation_config.json"):
            config = json.loads((tmp_path / "hf" / name).read_text())
            (tmp_path / "hf" / name).write_text(json.dumps({**config, "eos_token_id": eos}))

    set_eos(1)
    out = ok("from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ours")
    assert out.rstrip().endswith("--eod-token-id 1")
    ok("to-hf", "--load", tmp_path / "ours", "--hf-dir", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "generation_config.json").read_text())[
        "eos_token_id"] == 1
    for name in ("tokenizer.json", "tokenizer_config.json"):  # as they were: no eos named
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    assert AutoTokenizer.from_pretrained(tmp_path / "back").convert_ids_to_tokens(1) == "<|pad|>"
    set_eos(None)
    assert_refused(tmp_path, ["from-hf", "--hf-dir", tmp_path / "hf", "--save",
                              tmp_path / "out"], "--hf-dir", "no eos")
    assert_refused(tmp_path, ["from-hf", "--hf-dir", tmp_path / "hf", "--save",
                              tmp_path / "out", "--eod-token-id", "300"], "--eod-token-id",
                   "outside the vocabulary")
    out = ok("from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ours2",
             "--eod-token-id", "0")
    assert out.rstrip().endswith("--eod-token-id 0")


# -- bad input: one line, exit 2, nothing written --------------------------------------------------

def assert_refused(tmp_path, args, where, *words):
    rc, out, err = run_convert(*args)
    assert rc == 2 and out == "", err
    assert err.count("\n") == 1 and err.startswith(f"error: {where}: "), err
    for word in words:
        assert word in err, err
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp-" in n or n.startswith(".old-")]
    assert leftovers == [] and not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("name,arch,words", [
    ("mistral", "llama", ["--window-size 16", "Llama has no sliding window"]),
    ("qwen3", "qwen2", ["--qk-layernorm", "--disable-bias-linear without --add-qkv-bias"]),
    ("llama-bias", "qwen2", ["--add-bias-linear: Qwen2 has biases on q, k and v only"]),
    ("qwen2", "mistral", ["--add-qkv-bias"]),
    ("llama-bias", "qwen3", ["--add-bias-linear", "--qk-layernorm"]),
    ("llama-llama3", "gpt2", ["--position-embedding-type rope"]),
])
def test_feature_the_family_cannot_hold(imported, tmp_path, name, arch, words):
    ours_dir = imported(name)[1]
    assert_refused(tmp_path, ["to-hf", "--load", ours_dir, "--hf-dir", tmp_path / "out",
                              "--arch", arch], "--arch", *words)


def test_bad_shard_size(imported, tmp_path):
    assert_refused(tmp_path, ["to-hf", "--load", imported("llama")[1], "--hf-dir",
                              tmp_path / "out", "--max-shard-size", "5 furlongs"],
                   "--max-shard-size")


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("case,changes,words", [
    ("llama-yarn", {"rope_parameters": {"attention_factor": 1.5}}, ["attention_factor 1.5"]),
    ("llama-yarn", {"rope_parameters": {"truncate": False}}, ["truncate false"]),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                   "long_factor": [2.0] * 8, "factor": 4.0,
                                   "original_max_position_embeddings": 64}},
     ["'longrope' is not supported"]),
    ("llama", {"rope_parameters": {"partial_rotary_factor": 0.5}}, ["partial_rotary_factor"]),
    ("qwen2", {"max_window_layers": 1, "layer_types": None}, ["some layers only"]),
    ("qwen3", {"attention_bias": True}, ["attention_bias"]),
    ("llama", {"eos_token_id": 300}, ["eos_token_id 300", "outside the vocabulary"]),
])
def test_hf_configs_we_cannot_hold(tmp_path, case, changes, words):
    make_hf(case, tmp_path / "hf")
    edit_config(tmp_path / "hf", **changes)
    assert_refused(tmp_path, ["from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "out"],
                   tmp_path / "hf" / "config.json", *words)


def test_tokenizer_bigger_than_the_model(tmp_path):
    make_hf("qwen3", tmp_path / "hf")  # vocab_size 256
    save_bpe_tokenizer(tmp_path / "hf", size=300)
    assert_refused(tmp_path, ["from-hf", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "out"],
                   tmp_path / "hf" / "tokenizer.json", "300 tokens", "vocab_size 256")


@pytest.mark.parametrize("damage,words", [
    ("unreadable", ["error: --hf-dir: ", "tokenizer.json is not a Hugging Face tokenizer"]),
    ("eos", ["error: --hf-dir: ", "tokenizer_config.json: eos_token '<nope>' is not in the "
                                  "vocabulary"]),
])
def test_bad_tokenizer_files(tmp_path, damage, words):
    make_hf("qwen3", tmp_path / "hf", vocab_size=320)
    save_bpe_tokenizer(tmp_path / "hf")
    if damage == "unreadable":
        (tmp_path / "hf" / "tokenizer.json").write_text("{oops")
    else:
        path = tmp_path / "hf" / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token": "<nope>"}))
    rc, out, err = run_convert("from-hf", "--hf-dir", tmp_path / "hf", "--save",
                               tmp_path / "out")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert all(w in err for w in words), err
    assert not os.path.exists(tmp_path / "out")


@pytest.fixture(scope="module", autouse=True)
def print_measured():
    yield
    if MEASURED:
        print("\nlogits max |difference| (fp32):")
        for (name, direction, span), diff in sorted(MEASURED.items()):
            print(f"  {name:18s} {direction:22s} {span:18s} {diff:.3g}")


def test_cases_cover_every_family_and_rope_type():
    assert {FAMILY[p] for p, _ in CASES.values()} == set(convert.FAMILIES.values())
    types = {k.get("rope_parameters", {}).get("rope_type", "default") for _, k in CASES.values()}
    assert types == {"default", "linear", "llama3", "yarn"}
