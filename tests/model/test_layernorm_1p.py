"""--apply-layernorm-1p: norms store gamma - 1 (zero at initialization) and scale by
weight + 1. The same function as the plain norm with the weight shifted by 1; recorded in
the checkpoint's model shape; exported to Hugging Face as gamma (and imported back as a
plain checkpoint, which a run with the flag refuses)."""

import importlib.util
import os
import sys

import pytest
import torch

from helpers import REPO

KINDS = ("LayerNorm", "RMSNorm")


def model_config(normalization: str, one_p: bool):
    from megaulysses.config import ModelConfig
    gpt2 = normalization == "LayerNorm"
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                       normalization=normalization, apply_layernorm_1p=one_p,
                       position_embedding_type="learned_absolute" if gpt2 else "rope",
                       swiglu=not gpt2, add_bias_linear=gpt2, hidden_dropout=0.0,
                       attention_dropout=0.0, vocab_size=100, make_vocab_size_divisible_by=4)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_centered_norm_is_the_plain_norm_with_weight_plus_1(kind):
    from megaulysses.model.layers import build_norm
    torch.manual_seed(0)
    h = 16
    zc, plain = build_norm(kind, h, 1e-5, True), build_norm(kind, h, 1e-5)
    assert torch.equal(zc.weight, torch.zeros(h))  # gamma - 1 starts at 0
    with torch.no_grad():
        zc.weight.normal_()
        plain.weight.copy_(zc.weight + 1.0)
        if kind == "LayerNorm":
            zc.bias.normal_()
            plain.bias.copy_(zc.bias)
    x = torch.randn(2, 5, h)
    outs, grads = [], []
    for norm in (zc, plain):
        xi = x.clone().requires_grad_()
        y = norm(xi)
        (y * torch.arange(h)).sum().backward()
        outs.append(y)
        grads.append([xi.grad] + [p.grad for p in norm.parameters()])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_initial_model_computes_as_the_plain_one(kind):
    """Zero norm weights at initialization, every other weight the same: equal logits."""
    from megaulysses.model.attention import sdpa_attention
    from megaulysses.model.gpt import build_model
    zc = build_model(model_config(kind, True), sdpa_attention, seed=1)
    plain = build_model(model_config(kind, False), sdpa_attention, seed=1)
    norms = [n for n, _ in zc.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 5  # two per block, the final one
    assert all(not p.any() for n, p in zc.named_parameters() if n in norms)
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        assert torch.equal(zc(tokens), plain(tokens))


def test_checkpoint_shape_records_it():
    """A checkpoint saved with the other convention is refused at --load, naming the flag;
    one saved before the flag existed (no key) holds plain weights."""
    from megaulysses.config import CheckpointError
    from megaulysses.training.checkpoint import check_meta
    one_p, plain = (model_config("LayerNorm", v).shape_dict() for v in (True, False))
    assert one_p["apply_layernorm_1p"] and not plain["apply_layernorm_1p"]
    old = {k: v for k, v in plain.items() if k != "apply_layernorm_1p"}
    check_meta("ck", {"model": old}, {"model": plain})
    for saved, run in ((old, one_p), (plain, one_p), (one_p, plain)):
        with pytest.raises(CheckpointError, match="--apply-layernorm-1p"):
            check_meta("ck", {"model": saved}, {"model": run})


def _converter():
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", os.path.join(REPO, "tools", "convert_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["convert_checkpoint"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind,hf_norm", [("LayerNorm", "transformer.h.0.ln_1.weight"),
                                          ("RMSNorm", "model.layers.0.input_layernorm.weight")])
def test_export_writes_gamma_and_imports_back_as_plain(kind, hf_norm, tmp_path, capsys):
    """to-hf: Hugging Face gets weight + 1 and computes our logits; from-hf: a plain
    checkpoint (its norm weights are gamma) with the same logits, which a run with
    --apply-layernorm-1p refuses."""
    from transformers import AutoModelForCausalLM
    from megaulysses.config import CheckpointError
    from megaulysses.model.attention import sdpa_attention
    from megaulysses.model.gpt import build_model
    from megaulysses.training.checkpoint import check_meta, model_config as from_shape
    from megaulysses.training.checkpoint import read_model_checkpoint
    from megaulysses.training.saver import write_model_checkpoint
    convert = _converter()
    cfg = model_config(kind, True)
    ours = build_model(cfg, sdpa_attention, seed=2)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)  # trained-looking gamma - 1 (and beta)
    write_model_checkpoint(str(tmp_path / "ours"), ours.state_dict(), cfg.shape_dict())
    assert convert.main(["to-hf", "--load", str(tmp_path / "ours"), "--hf-dir",
                         str(tmp_path / "hf")]) == 0
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(theirs.state_dict()[hf_norm], ours.layers["0"].attn_norm.weight + 1.0)
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        want = ours.eval()(tokens)
        assert (theirs.eval()(tokens).logits - want).abs().max().item() <= 1e-4
    assert convert.main(["from-hf", "--hf-dir", str(tmp_path / "hf"), "--save",
                         str(tmp_path / "back")]) == 0
    meta, state = read_model_checkpoint(str(tmp_path / "back"))
    assert meta["model"]["apply_layernorm_1p"] is False
    back = build_model(from_shape(meta["model"]), sdpa_attention, seed=0)
    back.load_state_dict(state)
    assert torch.equal(back.head.norm.weight, ours.head.norm.weight + 1.0)
    with torch.no_grad():
        assert (back.eval()(tokens) - want).abs().max().item() <= 1e-5
    with pytest.raises(CheckpointError, match="--apply-layernorm-1p=False but this run has True"):
        check_meta(str(tmp_path / "back"), meta, {"model": cfg.shape_dict()})
    capsys.readouterr()  # the export's warning: no tokenizer in a hand-written checkpoint
