"""Our GPT's parameters <-> Megatron-LM's (megatron-core GPTModel), as whole tensors.

Megatron-LM's names, one layer (the local spec's module names; torch_dist stores the two
pre-norms under Transformer Engine's names whatever spec was used, see NORM_ALIASES):

    embedding.word_embeddings.weight          [V, h]      vocab-split across tp
    embedding.position_embeddings.weight      [P, h]      learned_absolute only
    decoder.layers.i.self_attention.linear_qkv.layer_norm_{weight,bias}
    decoder.layers.i.self_attention.linear_qkv.{weight,bias}   [ng*(np/ng+2)*hn, h]
    decoder.layers.i.self_attention.{q,k}_layernorm.weight     [hn]  (--qk-layernorm)
    decoder.layers.i.self_attention.linear_proj.{weight,bias}  [h, np*hn]
    decoder.layers.i.mlp.linear_fc1.layer_norm_{weight,bias}
    decoder.layers.i.mlp.linear_fc1.{weight,bias}              [f or 2f, h]
    decoder.layers.i.mlp.linear_fc2.{weight,bias}              [h, f]
    decoder.final_layernorm.{weight,bias}
    output_layer.weight                       [V, h]      untied models only

Layouts, in the whole (tensor-parallel size 1) tensor:
- linear_qkv is grouped per query group: for each of the ng groups, its np/ng query heads,
  then its key head, then its value head (hn rows each). Without GQA ng = np, so it is per
  head [q; k; v]. Ours holds q, k and v apart, heads in order: a permutation of rows.
- SwiGLU's linear_fc1 is [gate; up] (Megatron applies silu to the first half). Tensor-
  parallel rank r holds [gate_r; up_r]: splitting or merging ranks is not a plain split
  of the whole tensor (tp_split / tp_merge below know this).
Norm weights are stored as the model holds them (gamma, or gamma - 1 under
--apply-layernorm-1p, as ours), so no tensor changes beyond these permutations.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megaulysses.config import ModelConfig

LAYER = "decoder.layers.{}."
# Megatron-LM's legacy (local spec) norm names -> the names torch_dist and TE use.
NORM_ALIASES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _norm_keys(prefix_ours: str, prefix_meg: str, cfg: ModelConfig) -> list[tuple[str, str]]:
    keys = [("weight", "weight")]
    if cfg.normalization == "LayerNorm":
        keys.append(("bias", "bias"))
    return [(prefix_ours + a, prefix_meg + b) for a, b in keys]


def _linear_keys(ours: str, meg: str, bias: bool) -> list[tuple[str, str]]:
    return [(ours + ".weight", meg + ".weight")] + ([(ours + ".bias", meg + ".bias")]
                                                      if bias else [])


def simple_pairs(cfg: ModelConfig, layer: int) -> list[tuple[str, str]]:
    """(our name, Megatron's name) of one layer's tensors that map one to one."""
    o, m = f"layers.{layer}.", LAYER.format(layer)
    pairs = _norm_keys(o + "attn_norm.", m + "self_attention.linear_qkv.layer_norm_", cfg)
    pairs += _norm_keys(o + "mlp_norm.", m + "mlp.linear_fc1.layer_norm_", cfg)
    pairs += _linear_keys(o + "attn.out", m + "self_attention.linear_proj", cfg.add_bias_linear)
    pairs += _linear_keys(o + "mlp.fc2", m + "mlp.linear_fc2", cfg.add_bias_linear)
    if cfg.qk_layernorm:
        pairs += [(o + f"attn.{x}_norm.weight", m + f"self_attention.{x}_layernorm.weight")
                  for x in "qk"]
        if cfg.normalization == "LayerNorm":
            pairs += [(o + f"attn.{x}_norm.bias", m + f"self_attention.{x}_layernorm.bias")
                      for x in "qk"]
    if not cfg.swiglu:
        pairs += _linear_keys(o + "mlp.fc1", m + "mlp.linear_fc1", cfg.add_bias_linear)
    return pairs


def global_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, Megatron's name) of the tensors outside the layers."""
    pairs = [("embed.word.weight", "embedding.word_embeddings.weight")]
    if cfg.position_embedding_type == "learned_absolute":
        pairs.append(("embed.position.weight", "embedding.position_embeddings.weight"))
    pairs += _norm_keys("head.norm.", "decoder.final_layernorm.", cfg)
    if cfg.untie_embeddings_and_output_weights:
        pairs.append(("head.output.weight", "output_layer.weight"))
    return pairs


def _qkv_bias(cfg: ModelConfig) -> bool:
    return cfg.add_bias_linear or cfg.add_qkv_bias


# -- q, k, v <-> linear_qkv ----------------------------------------------------------------

def fuse_qkv(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor:
    """[np*hn, ...], [ng*hn, ...], [ng*hn, ...] -> [ng*(np/ng+2)*hn, ...], grouped."""
    ng, hn = cfg.num_kv_heads, cfg.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, -1, *rest)  # [ng, (np/ng)*hn, ...]
    k, v = k.reshape(ng, hn, *rest), v.reshape(ng, hn, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(cfg: ModelConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of fuse_qkv."""
    ng, hn = cfg.num_kv_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // ng * hn
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, per_group + 2 * hn, *rest)
    q, k, v = grouped.split([per_group, hn, hn], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def to_megatron(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our whole-model state -> Megatron-LM's, whole tensors (tensor-parallel size 1)."""
    out = {meg: ours[o] for o, meg in global_pairs(cfg)}
    for i in range(cfg.num_layers):
        out.update({meg: ours[o] for o, meg in simple_pairs(cfg, i)})
        o, m = f"layers.{i}.", LAYER.format(i)
        kinds = ("weight", "bias") if _qkv_bias(cfg) else ("weight",)
        for kind in kinds:
            out[m + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(
                cfg, *(ours[o + f"attn.{x}.{kind}"] for x in "qkv"))
        if cfg.swiglu:
            for kind in ("weight", "bias") if cfg.add_bias_linear else ("weight",):
                out[m + f"mlp.linear_fc1.{kind}"] = torch.cat(
                    [ours[o + f"mlp.gate.{kind}"], ours[o + f"mlp.fc1.{kind}"]])
    return {k: v.contiguous() for k, v in out.items()}


def megatron_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name Megatron-LM's GPTModel of this shape has (tp 1, all layers)."""
    names = [meg for _, meg in global_pairs(cfg)]
    for i in range(cfg.num_layers):
        names += [meg for _, meg in simple_pairs(cfg, i)]
        m = LAYER.format(i)
        names.append(m + "self_attention.linear_qkv.weight")
        if _qkv_bias(cfg):
            names.append(m + "self_attention.linear_qkv.bias")
        if cfg.swiglu:
            names += [m + "mlp.linear_fc1.weight"] + (
                [m + "mlp.linear_fc1.bias"] if cfg.add_bias_linear else [])
    return names


def from_megatron(cfg: ModelConfig, meg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron-LM's whole tensors (tp 1 layout) -> our state. Every name must be there."""
    ours = {o: meg[m] for o, m in global_pairs(cfg)}
    for i in range(cfg.num_layers):
        ours.update({o: meg[m] for o, m in simple_pairs(cfg, i)})
        o, m = f"layers.{i}.", LAYER.format(i)
        for kind in ("weight", "bias") if _qkv_bias(cfg) else ("weight",):
            q, k, v = split_qkv(cfg, meg[m + f"self_attention.linear_qkv.{kind}"])
            ours.update({o + f"attn.q.{kind}": q, o + f"attn.k.{kind}": k,
                         o + f"attn.v.{kind}": v})
        if cfg.swiglu:
            for kind in ("weight", "bias") if cfg.add_bias_linear else ("weight",):
                gate, up = meg[m + f"mlp.linear_fc1.{kind}"].chunk(2)
                ours[o + f"mlp.gate.{kind}"], ours[o + f"mlp.fc1.{kind}"] = gate, up
    return {k: v.contiguous() for k, v in ours.items()}


# -- tensor-parallel shards ------------------------------------------------------------------

def tp_axis(name: str) -> Optional[int]:
    """The axis Megatron-LM splits `name` on across tensor-parallel ranks (None: every
    rank holds it whole). Column-parallel: qkv, fc1, the vocabulary; row-parallel:
    linear_proj and fc2 weights (their biases are added once, after the reduction)."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if "layer_norm_" in name or "layernorm" in name:
        return None
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight",
                      "linear_fc1.bias", "word_embeddings.weight", "output_layer.weight")):
        return 0
    return None


def _glu(name: str, cfg: ModelConfig) -> bool:
    return cfg.swiglu and "linear_fc1." in name and "layer_norm" not in name


def tp_split(cfg: ModelConfig, name: str, whole: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """One whole tensor -> its tp shards, as each tensor-parallel rank holds it."""
    axis = tp_axis(name)
    if axis is None:
        return [whole] * tp
    if _glu(name, cfg):  # rank r: [gate_r; up_r]
        gate, up = whole.chunk(2)
        pairs = zip(gate.chunk(tp), up.chunk(tp), strict=True)
        return [torch.cat(pair).contiguous() for pair in pairs]
    return [t.contiguous() for t in whole.chunk(tp, dim=axis)]


def tp_merge(cfg: ModelConfig, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of tp_split (replicated tensors: rank 0's)."""
    axis = tp_axis(name)
    if axis is None:
        return shards[0]
    if _glu(name, cfg):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=axis)


def check_shapes(cfg: ModelConfig, meg: dict[str, torch.Tensor],
                 where: Callable[[str], str]) -> None:
    """Each tensor's shape is the one this model shape gives (a mismatch names the file)."""
    from megaulysses.model.gpt import GPT
    with torch.device("meta"):
        want = to_megatron(cfg, GPT(cfg).state_dict())
    from megaulysses.config import CheckpointError
    for name, tensor in meg.items():
        if name in want and tuple(tensor.shape) != tuple(want[name].shape):
            raise CheckpointError(f"{where(name)}: {name} has shape {tuple(tensor.shape)} "
                                  f"but the checkpoint's args give {tuple(want[name].shape)}")
