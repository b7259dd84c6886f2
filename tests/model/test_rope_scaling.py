"""RoPE scalings (llama3, linear, yarn), q/k/v-only biases and per-head q/k norms against
transformers 5.24, built here as tiny random models (nothing downloaded).

- inverse frequencies == transformers' ROPE_INIT_FUNCTIONS bit for bit (both fp32, the same
  operations in the same order), the attention factor to 1e-12;
- cos and sin == transformers' rotary embedding within 1e-6 at positions up to 8K (the same
  fp32 angles; cos/sin kernels may differ in the last bit);
- the parameters: [d] q_norm and k_norm per layer, biases on q, k, v alone, initial values;
- the logits of tiny Qwen3 (per-head q/k RMSNorm, head dim != hidden/heads, GQA, YaRN),
  Qwen2 (q/k/v biases, linear) and Llama 3.1 (llama3 scaling) equal ours within 1e-5.
"""

import math

import pytest
import torch

from helpers import llama_config

from megaulysses.model.rope import attention_factor, inverse_frequencies, rotary_angles

COS_ATOL = 1e-6
LOGITS_ATOL = 1e-5

# name: (head dim, theta, max positions, transformers' rope_parameters, our fields)
CASES = {
    "llama3-llama3.1": (128, 500000.0, 131072,
                        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192),
                        dict(use_rope_scaling=True)),
    # wavelengths kept (below 32/2), blended, and scaled (above 32/0.5)
    "llama3-small": (16, 10000.0, 128,
                     dict(rope_type="llama3", factor=4.0, low_freq_factor=0.5,
                          high_freq_factor=2.0, original_max_position_embeddings=32),
                     dict(use_rope_scaling=True, rope_scaling_factor=4.0,
                          rope_scaling_low_freq_factor=0.5, rope_scaling_high_freq_factor=2.0,
                          original_max_position_embeddings=32)),
    "linear": (64, 10000.0, 4096, dict(rope_type="linear", factor=4.0),
               dict(rotary_seq_len_interpolation_factor=4.0)),
    "yarn-qwen2.5": (128, 1e6, 131072,
                     dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),
                     dict(rope_type="yarn", rotary_scaling_factor=4.0,
                          original_max_position_embeddings=32768)),
    # the original context defaults to max positions on both sides; explicit truncate=True
    "yarn-default-original": (32, 10000.0, 4096,
                              dict(rope_type="yarn", factor=8.0, truncate=True),
                              dict(rope_type="yarn", rotary_scaling_factor=8.0)),
    "yarn-betas-mscale": (64, 10000.0, 163840,
                          dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                               beta_fast=16.0, beta_slow=2.0, mscale=0.9, mscale_all_dim=0.5),
                          dict(rope_type="yarn", rotary_scaling_factor=40.0,
                               original_max_position_embeddings=4096, yarn_beta_fast=16.0,
                               yarn_beta_slow=2.0, mscale=0.9, mscale_all_dim=0.5)),
    # the ramp's ends both rounded to dimension 0 (an original context < 2 pi turns):
    # transformers widens it by 0.001
    "yarn-narrow-ramp": (8, 10000.0, 64,
                         dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=4),
                         dict(rope_type="yarn", rotary_scaling_factor=2.0,
                              original_max_position_embeddings=4)),
}


def configs(name):
    from transformers import LlamaConfig
    d, theta, positions, hf, ours = CASES[name]
    theirs = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d,
                         max_position_embeddings=positions,
                         rope_parameters=dict(rope_theta=theta, **hf))
    return theirs, llama_config(hidden_size=4 * d, num_attention_heads=4, kv_channels=d,
                                rotary_base=theta, max_position_embeddings=positions,
                                seq_length=16, **ours)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theirs_cfg, cfg = configs(name)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[theirs_cfg.rope_parameters["rope_type"]](theirs_cfg)
    ours = inverse_frequencies(cfg)
    assert ours.dtype == torch.float32 and torch.equal(ours, inv_freq), name
    assert attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    assert cfg.rope_scaling == {"llama3": "llama3", "linear": "linear",
                                "yarn": "yarn"}[name.split("-")[0]]


def test_scalings_really_scale():
    """Each case moves some frequencies and keeps others (llama3, yarn), or all (linear)."""
    for name in CASES:
        _, cfg = configs(name)
        plain = inverse_frequencies(llama_config(hidden_size=cfg.hidden_size,
                                                 num_attention_heads=4,
                                                 kv_channels=cfg.head_dim,
                                                 rotary_base=cfg.rotary_base))
        moved = ~torch.isclose(inverse_frequencies(cfg), plain, rtol=1e-9)
        assert moved.any(), name
        assert moved.all() == (name == "linear"), name


def test_yarn_ramp_is_truncated_as_transformers_default():
    """transformers' truncate=False (gpt-oss) keeps the ramp's fractional ends: a different
    model. Ours is truncate=True, its default and Megatron-LM's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theirs_cfg, cfg = configs("yarn-qwen2.5")
    theirs_cfg.rope_parameters["truncate"] = False
    loose, _ = ROPE_INIT_FUNCTIONS["yarn"](theirs_cfg)
    assert not torch.allclose(inverse_frequencies(cfg), loose, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_equal_transformers_rotary_embedding(name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    theirs_cfg, cfg = configs(name)
    emb = LlamaRotaryEmbedding(theirs_cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.arange(64), torch.randint(64, 8192, (200,), generator=g)])[None]
    cos, sin = emb(torch.zeros(1, pos.shape[1], 1), pos)  # [1, s, d]: halves repeated
    ours_cos, ours_sin = rotary_angles(pos, cfg)  # [1, s, 1, d/2]
    scale = attention_factor(cfg)
    for theirs, ours in ((cos, ours_cos), (sin, ours_sin)):
        ours = torch.cat([ours.squeeze(2)] * 2, dim=-1)
        assert ours.dtype == torch.float32
        diff = (theirs - ours).abs().max().item()
        assert diff <= COS_ATOL * scale, (name, diff)


@pytest.mark.parametrize("norm,one_p", [("RMSNorm", False), ("LayerNorm", True)])
def test_qk_norm_and_qkv_bias_parameters(norm, one_p):
    """Per layer: q_norm and k_norm of the head dimension (weights 1, or 0 under
    --apply-layernorm-1p; LayerNorm's biases 0), zero biases on q, k, v and on nothing else."""
    from megaulysses.model.attention import math_attention
    from megaulysses.model.gpt import build_model
    cfg = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       kv_channels=24, vocab_size=128, qk_layernorm=True, add_qkv_bias=True,
                       normalization=norm, apply_layernorm_1p=one_p)
    params = dict(build_model(cfg, math_attention, seed=0).named_parameters())
    for i in range(2):
        for qk in "qk":
            w = params[f"layers.{i}.attn.{qk}_norm.weight"]
            assert w.shape == (24,) and torch.equal(w, torch.full((24,), 0.0 if one_p else 1.0))
            assert (f"layers.{i}.attn.{qk}_norm.bias" in params) == (norm == "LayerNorm")
        for name, rows in (("q", 4 * 24), ("k", 2 * 24), ("v", 2 * 24)):
            assert torch.equal(params[f"layers.{i}.attn.{name}.bias"], torch.zeros(rows))
    biased = {n.rsplit(".", 2)[-2] for n in params if n.endswith(".bias") and "norm" not in n}
    assert biased == {"q", "k", "v"}


# ---- whole tiny models: logits against transformers ---------------------------------------

H, HEADS, KV, D, FFN, VOCAB, S = 64, 4, 2, 24, 96, 128, 48
FAMILIES = {
    # Qwen3: per-head q/k RMSNorm, head dim 24 != 64/4, GQA, YaRN from 16 positions, tied
    "qwen3-yarn": ("Qwen3", dict(rope_type="yarn", factor=4.0,
                                 original_max_position_embeddings=16),
                   dict(qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=4.0,
                        original_max_position_embeddings=16)),
    # Qwen2: q/k/v biases only, linear interpolation, untied
    "qwen2-linear": ("Qwen2", dict(rope_type="linear", factor=2.0),
                     dict(add_qkv_bias=True, rotary_seq_len_interpolation_factor=2.0,
                          untie_embeddings_and_output_weights=True)),
    # Llama 3.1: llama3 scaling from 16 positions
    "llama-llama3": ("Llama", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=16),
                     dict(use_rope_scaling=True, original_max_position_embeddings=16,
                          untie_embeddings_and_output_weights=True)),
}
# ours -> transformers' name, per block
BLOCK_NAMES = {"attn_norm": "input_layernorm", "attn.q": "self_attn.q_proj",
               "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
               "attn.out": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm",
               "attn.k_norm": "self_attn.k_norm", "mlp_norm": "post_attention_layernorm",
               "mlp.gate": "mlp.gate_proj", "mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj"}


def hf_name(ours: str) -> str:
    if ours == "embed.word.weight":
        return "model.embed_tokens.weight"
    if ours == "head.norm.weight":
        return "model.norm.weight"
    if ours == "head.output.weight":
        return "lm_head.weight"
    _, i, rest = ours.split(".", 2)
    module, _, kind = rest.rpartition(".")
    return f"model.layers.{i}.{BLOCK_NAMES[module]}.{kind}"


def tiny_transformers(family: str, rope: dict, tied: bool):
    import transformers
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
        max_position_embeddings=S, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters=dict(rope_theta=1000.0, **rope), attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms and biases away from their initial 1 and 0
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_equal_transformers(name):
    from megaulysses.model.attention import math_attention
    from megaulysses.model.gpt import build_model
    family, rope, ours = FAMILIES[name]
    theirs = tiny_transformers(family, rope, not ours.get("untie_embeddings_and_output_weights"))
    cfg = llama_config(num_layers=2, hidden_size=H, num_attention_heads=HEADS,
                       num_query_groups=KV, kv_channels=D, ffn_hidden_size=FFN, seq_length=S,
                       rotary_base=1000.0, norm_epsilon=1e-6, vocab_size=VOCAB, **ours)
    model = build_model(cfg, math_attention, seed=0).eval()
    state = theirs.state_dict()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state[hf_name(n)])
    assert len(state) == len(list(model.parameters())) + (0 if "lm_head.weight" not in state
                                                          or cfg.untie_embeddings_and_output_weights
                                                          else 1)
    tokens = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(tokens).logits
        got = model(tokens)
    err = (got - want).abs().max().item()
    assert err < LOGITS_ATOL, (name, err)
    assert math.isfinite(err)
