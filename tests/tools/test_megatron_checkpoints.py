"""Megatron-LM's checkpoints in and out, checked against megatron-core itself.

megatron-core 0.16.1 (installed by .ci/run from the test extras) builds tiny GPTModels
with its local layer spec on gloo CPU ranks (tests/tools/megatron_oracle.py: the CPU
workarounds), GPT-2 style (LayerNorm, learned positions, biases, tanh GeLU, tied) and
Llama style (RMSNorm, RoPE, SwiGLU, GQA, untied, no biases), every weight random, norms and
biases too, so that a swapped layout cannot pass.

- Megatron-LM -> ours: megatron-core saves (torch_dist through its own
  dist_checkpointing.save; the legacy torch format as Megatron-LM's training loop writes
  it) at tp 1, tp 2 and pp 2; `convert_checkpoint.py from-megatron` converts; our GPT's
  logits must equal megatron-core's forward on the same tokens.
- ours -> Megatron-LM: `to-megatron` writes each format at the sizes asked; megatron-core
  loads it strictly (dist_checkpointing.load with nothing missing or unexpected, or
  load_state_dict(strict=True)) at tp 1, tp 2 and pp 2, and its logits must equal ours.
- the same for `to-hf` from a Megatron-LM directory (transformers' logits) and for
  `--load` of one in pretrain_gpt.py (a training step's loss equals the converted one's).

Tolerance: LOGITS_ATOL on logits of size ~10, fp32 both sides (summation order only).
"""

import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dist import run_ranks
from helpers import REPO, load_tool, run_main

pytest.importorskip("megatron.core", reason="megatron-core is the oracle (pip install "
                                            "'.[test]' installs it)")

convert = load_tool("convert_checkpoint")

LOGITS_ATOL = 1e-5
STYLES = ("gpt", "llama")
GRIDS = ((1, 1), (2, 1), (1, 2))  # (tp, pp) on 2 ranks: dp 2, tp 2, pp 2
MEGATRON_SEED, OTHER_SEED = 1234, 99  # OTHER: what megatron-core holds before a load
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
COMMON_STATE = "common_state/shard_0_1"  # megatron-core >= 0.19's common state key


def ours_config(style: str):
    """Our ModelConfig of megatron_oracle's DEFAULT_SHAPES[style]."""
    from megaulysses.config import ModelConfig
    common = dict(num_layers=4, hidden_size=64, num_attention_heads=4, kv_channels=16,
                  vocab_size=256, make_vocab_size_divisible_by=128, seq_length=32,
                  max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
    if style == "gpt":
        return ModelConfig(**common, ffn_hidden_size=128)
    return ModelConfig(**common, ffn_hidden_size=96, num_query_groups=2,
                       position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                       add_bias_linear=False, untie_embeddings_and_output_weights=True)


def our_logits(cfg, state) -> np.ndarray:
    from megaulysses.model.gpt import GPT
    model = GPT(cfg)
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        return model(TOKENS).float().numpy()


def max_diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


# -- megatron-core's side (spawned ranks) ----------------------------------------------------

def megatron_saves(rank, world, out_dir):
    """Each style at each grid: megatron-core's logits, and its checkpoints in both formats
    ({out_dir}/{style}_tp{tp}_pp{pp}_{fmt})."""
    import megatron_oracle as mo
    logits = {}
    for tp, pp in GRIDS:
        mo.init_megatron(rank, world, tp, pp)
        for style in STYLES:
            model = mo.build_model(style, seed=MEGATRON_SEED)
            key = f"{style}_tp{tp}_pp{pp}"
            logits[key] = mo.forward_logits(model, TOKENS).numpy()
            args = mo.megatron_args(style, tp=tp, pp=pp, consumed_train_samples=56)
            mo.save_torch_dist(model, os.path.join(out_dir, key + "_torch_dist"), 7, args)
            mo.save_legacy_torch(model, os.path.join(out_dir, key + "_torch"), 7, args)
    mo.destroy_megatron()
    return logits


def _load_019(model, iter_dir):
    """megatron-core >= 0.19's load: the common state from the DCP files (as its
    load_common_state_dict reads it, weights_only with its safe globals), the model's
    tensors by 0.16.1's own strict loader; the one key 0.16.1 does not know is the common
    state itself."""
    import argparse
    import torch.distributed.checkpoint as dcp
    from unittest import mock
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.validation import StrictHandling
    import megatron_oracle as mo

    def common_019(self_or_dir, checkpoint_dir=None):
        checkpoint_dir = str(checkpoint_dir or self_or_dir)
        state = {COMMON_STATE: io.BytesIO()}
        dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint_dir), no_dist=True)
        loaded = state[COMMON_STATE]
        if isinstance(loaded, io.BytesIO):
            loaded.seek(0)
            with torch.serialization.safe_globals([argparse.Namespace]):
                loaded = torch.load(loaded, weights_only=True)
        return loaded[0]

    sharded = {"model": model.sharded_state_dict(metadata=mo._sharded_sd_metadata())}
    with mock.patch.object(TorchCommonLoadStrategy, "load_common", common_019):
        loaded, in_ckpt_only, requested_only = dist_checkpointing.load(
            sharded, iter_dir, strict=StrictHandling.RETURN_ALL)
    assert not requested_only, requested_only
    assert set(in_ckpt_only) == {"common_state"}, in_ckpt_only
    model.load_state_dict(loaded["model"], strict=True)
    return common_019(iter_dir)


def megatron_loads(rank, world, cases):
    """megatron-core loads each (name, style, (tp, pp), fmt, iter_dir) strictly at that
    grid, into a model whose weights were other ones; its logits and common state."""
    import megatron_oracle as mo
    out = {}
    for grid in GRIDS:
        mo.init_megatron(rank, world, *grid)
        for name, style, at, fmt, iter_dir in cases:
            if at != grid:
                continue
            model = mo.build_model(style, seed=OTHER_SEED)
            if fmt == "torch":
                common = mo.load_legacy_torch(model, iter_dir)
            elif fmt == "torch_dist_019":
                common = _load_019(model, iter_dir)
            else:
                common = mo.load_torch_dist(model, iter_dir)
            args = common["args"]
            out[name] = (mo.forward_logits(model, TOKENS).numpy(), common["iteration"],
                         {k: getattr(args, k, None) for k in ARGS_MEGATRON_SETS})
    mo.destroy_megatron()
    return out


# What Megatron-LM's --use-checkpoint-args sets from a checkpoint (load_args_from_checkpoint:
# its _set_arg calls) that a dense GPT has: ours must equal megatron-core's own run's.
ARGS_MEGATRON_SETS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
    "group_query_attention", "kv_channels", "max_position_embeddings",
    "position_embedding_type", "add_position_embedding", "use_rotary_position_embeddings",
    "rotary_base", "rotary_percent", "rotary_interleaved", "add_bias_linear", "add_qkv_bias",
    "swiglu", "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
    "attention_dropout", "hidden_dropout", "num_experts", "padded_vocab_size")


# -- Megatron-LM -> ours -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_ckpts(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    logits = run_ranks(megatron_saves, 2, str(out), timeout=600, daemon=False)[0]
    return str(out), logits


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("fmt", ("torch_dist", "torch"))
@pytest.mark.parametrize("tp, pp", GRIDS)
def test_from_megatron_gives_megatron_cores_logits(megatron_ckpts, tmp_path, style, fmt,
                                                   tp, pp):
    from megaulysses.training.checkpoint import model_config, read_model_checkpoint
    out, logits = megatron_ckpts
    key = f"{style}_tp{tp}_pp{pp}"
    rc, stdout, err = run_main(convert, "from-megatron", "--load", f"{out}/{key}_{fmt}",
                               "--save", str(tmp_path / "ours"))
    assert rc == 0, err
    assert "not carried:" in err and "--load" in stdout
    meta, state = read_model_checkpoint(str(tmp_path / "ours"))
    cfg = model_config(meta["model"])
    # Megatron-LM pads the vocabulary to its divisor times tp: the divisor recorded is that
    divisor = {**ours_config(style).shape_dict(), "make_vocab_size_divisible_by": 128 * tp}
    assert cfg.shape_dict() == divisor
    assert (meta["iteration"], meta["consumed_train_samples"]) == (7, 56)
    assert meta["lr_schedule"]["lr"] == 3e-4 and meta["lr_schedule"]["lr_decay_iters"] == 100
    diff = max_diff(our_logits(cfg, state), logits[key])
    print(f"TABLE megatron->ours {fmt} {style} tp{tp} pp{pp}: {diff:.2e}")
    assert diff <= LOGITS_ATOL


def test_megatron_pickles_read_without_megatron(megatron_ckpts, tmp_path):
    """The args hold megatron-core's classes (AttnBackend): a machine without megatron
    reads them (each becomes a named placeholder)."""
    out, _ = megatron_ckpts
    code = ("import sys; sys.modules['megatron'] = None\n"  # import megatron fails
            "from megaulysses.training.megatron import read_megatron\n"
            f"c = read_megatron({out + '/llama_tp2_pp1_torch'!r})\n"
            "print(c.common['args'].attention_backend, c.cfg.num_layers)\n"
            f"c = read_megatron({out + '/gpt_tp1_pp2_torch_dist'!r})\n"
            "print(c.common['args'].attention_backend, c.cfg.num_layers)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["<megatron.core.transformer.enums.AttnBackend(5,)> 4"] * 2


def test_megatron_to_hf_in_one_command(megatron_ckpts, tmp_path):
    """Megatron-LM -> Hugging Face without a re-save (NVIDIA/Megatron-LM#1508)."""
    from transformers import AutoModelForCausalLM
    out, logits = megatron_ckpts
    for style, arch in (("llama", "LlamaForCausalLM"), ("gpt", "GPT2LMHeadModel")):
        hf_dir = str(tmp_path / style)
        rc, stdout, err = run_main(convert, "to-hf", "--load", f"{out}/{style}_tp2_pp1_torch_dist",
                                   "--hf-dir", hf_dir)
        assert rc == 0 and arch in stdout, err
        model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        with torch.no_grad():
            hf = model(TOKENS).logits.numpy()
        diff = max_diff(hf, logits[f"{style}_tp2_pp1"])
        print(f"TABLE megatron->hf torch_dist {style} tp2 pp1: {diff:.2e}")
        assert diff <= 1e-4  # transformers computes its rotary tables in another order


def test_load_a_megatron_directory_in_training(megatron_ckpts, tmp_path):
    """pretrain_gpt.py --load of a Megatron-LM directory, model flags from it: the same
    losses as loading the converted checkpoint, and it starts at Megatron-LM's iteration."""
    from helpers import read_jsonl
    import pretrain_gpt
    out, _ = megatron_ckpts
    run = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "9",
           "--lr", "1e-3", "--eval-iters", "0", "--use-checkpoint-args", "--log-interval", "1"]
    src = f"{out}/llama_tp1_pp2_torch"
    rc, _, err = run_main(convert, "from-megatron", "--load", src, "--save",
                          str(tmp_path / "ours"))
    assert rc == 0, err
    losses = []
    for name, load in (("direct", src), ("converted", str(tmp_path / "ours"))):
        jsonl = str(tmp_path / f"{name}.jsonl")
        assert pretrain_gpt.main([*run, "--load", load, "--metrics-jsonl", jsonl]) == 0
        records = [r for r in read_jsonl(jsonl) if "loss" in r]
        assert [r["iteration"] for r in records] == [8, 9]  # from Megatron-LM's 7
        losses.append([r["loss"] for r in records])
    assert losses[0] == losses[1]


# -- ours -> Megatron-LM -----------------------------------------------------------------------

def random_state(cfg, seed: int) -> dict:
    """Every weight random (norms near 1, biases small): a swapped layout cannot pass."""
    from megaulysses.model.gpt import GPT
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in GPT(cfg).state_dict().items():
        noise = torch.randn(t.shape, generator=gen)
        state[name] = 1 + 0.1 * noise if "norm" in name else (
            0.2 * noise if "embed" in name or "output" in name else 0.1 * noise)
    return state


# (name, style, grid megatron-core loads at, format, to-megatron flags)
EXPORTS = [
    ("dist019_tp2", "llama", (2, 1), "torch_dist_019", ["--tensor-model-parallel-size", "2"]),
    ("dist019_gpt", "gpt", (1, 1), "torch_dist_019", []),
    *[(f"dist_{s}_{tp}{pp}", s, (tp, pp), "torch_dist", ["--megatron-common-pt"])
      for s in STYLES for tp, pp in GRIDS],
    *[(f"legacy_{s}_{tp}{pp}", s, (tp, pp), "torch",
       ["--ckpt-format", "torch", "--transformer-impl", "local",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)])
      for s in STYLES for tp, pp in GRIDS],
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Our random models, exported by to-megatron and loaded back by megatron-core."""
    from megaulysses.training.saver import write_model_checkpoint
    root = tmp_path_factory.mktemp("exported")
    ours, cases = {}, []
    for style in STYLES:
        cfg = ours_config(style)
        state = random_state(cfg, seed=len(style))
        write_model_checkpoint(str(root / style), state, cfg.shape_dict(), iteration=12,
                               extra={"consumed_train_samples": 96})
        ours[style] = our_logits(cfg, state)
    for name, style, grid, fmt, flags in EXPORTS:
        save = str(root / name)
        rc, _, err = run_main(convert, "to-megatron", "--load", str(root / style), "--save",
                              save, *flags)
        assert rc == 0, err
        cases.append((name, style, grid, fmt, os.path.join(save, "iter_0000012")))
    ours["hf"] = hugging_face_to_megatron(root)
    cases.append(("hf", "llama", (2, 1), "torch_dist",
                  os.path.join(str(root / "hf_megatron"), "release")))
    loaded = run_ranks(megatron_loads, 2, cases, timeout=600)[0]
    return ours, loaded


def hugging_face_to_megatron(root) -> np.ndarray:
    """A transformers Llama of the oracle's llama shape -> from-hf -> to-megatron at tp 2:
    Hugging Face -> Megatron-LM in two commands. Returns transformers' logits."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms too: a swapped layout cannot pass
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        logits = hf(TOKENS).logits.numpy()
    hf.save_pretrained(str(root / "hf"))
    for args in (("from-hf", "--hf-dir", root / "hf", "--save", root / "hf_ours"),
                 ("to-megatron", "--load", root / "hf_ours", "--save", root / "hf_megatron",
                  "--tensor-model-parallel-size", "2", "--megatron-common-pt")):
        rc, _, err = run_main(convert, *args)
        assert rc == 0, err
    return logits


@pytest.mark.parametrize("name, style, grid, fmt, flags", EXPORTS, ids=[e[0] for e in EXPORTS])
def test_to_megatron_loads_into_megatron_core(exported, name, style, grid, fmt, flags):
    ours, loaded = exported
    logits, iteration, args = loaded[name]
    diff = max_diff(logits, ours[style])
    print(f"TABLE ours->megatron {fmt} {style} tp{grid[0]} pp{grid[1]} ({name}): {diff:.2e}")
    assert diff <= LOGITS_ATOL
    assert iteration == 12


def test_hugging_face_to_megatron(exported):
    """from-hf then to-megatron: megatron-core at tp 2 computes transformers' logits."""
    ours, loaded = exported
    logits, iteration, _ = loaded["hf"]
    diff = max_diff(logits, ours["hf"])
    print(f"TABLE hf->ours->megatron torch_dist llama tp2 pp1: {diff:.2e}")
    assert diff <= 1e-4 and iteration == 0  # transformers' rotary tables: another order


def test_exported_args_are_what_megatron_lm_records(exported):
    """The args Megatron-LM's --use-checkpoint-args reads: the values megatron-core's own
    run records for the same model (tests/tools/megatron_oracle.py's megatron_args)."""
    import megatron_oracle as mo
    _, loaded = exported
    for name, style, grid, _fmt, _flags in EXPORTS:  # (the Hugging Face case: 0.0 dropout)
        theirs = mo.megatron_args(style, tp=grid[0], pp=grid[1])
        ours = loaded[name][2]
        for key in ARGS_MEGATRON_SETS:
            if key in ("hidden_dropout", "attention_dropout"):  # a model-only source: 0.1,
                continue  # Megatron-LM's default (a training run's own are carried)
            assert ours[key] == getattr(theirs, key), (name, key, ours[key])


def test_common_state_loads_with_weights_only(tmp_path):
    """megatron-core >= 0.19 reads the common state with torch.load(weights_only=True) and
    its safe globals (argparse.Namespace among them): our args hold nothing else."""
    import argparse
    from megaulysses.training.megatron.read import COMMON_KEY, _dist_load
    from megaulysses.training.saver import write_model_checkpoint
    cfg = ours_config("llama")
    write_model_checkpoint(str(tmp_path / "ours"), random_state(cfg, 0), cfg.shape_dict())
    rc, _, err = run_main(convert, "to-megatron", "--load", str(tmp_path / "ours"), "--save",
                          str(tmp_path / "meg"))
    assert rc == 0, err
    state = {COMMON_KEY: io.BytesIO()}
    _dist_load(str(tmp_path / "meg" / "release"), state)  # the raw bytes, as stored
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(state[COMMON_KEY], weights_only=True)[0]
    assert common["args"].num_layers == 4 and common["iteration"] == 0
    assert common["checkpoint_version"] == 3.0
