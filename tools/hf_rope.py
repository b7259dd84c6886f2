"""RoPE scaling between our flags and transformers' rope_parameters (config.json's
"rope_parameters", or "rope_scaling" in files written before transformers 5).

  transformers rope_type   ours
  default                  (no scaling)
  linear    factor         --rotary-seq-len-interpolation-factor
  llama3    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
                           --use-rope-scaling --rope-scaling-factor
                           --rope-scaling-low-freq-factor --rope-scaling-high-freq-factor
                           --original-max-position-embeddings
  yarn      factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
            mscale_all_dim
                           --rope-type yarn --rotary-scaling-factor
                           --original-max-position-embeddings --yarn-beta-fast
                           --yarn-beta-slow --mscale --mscale-all-dim

YaRN's attention factor (cos and sin are multiplied by it): transformers computes
m(factor, mscale) / m(factor, mscale_all_dim) when both are given and non-zero, else
m(factor, 1), where m(f, x) = 0.1 * x * ln(f) + 1 (1 for f <= 1); ours always computes the
ratio, with --mscale-all-dim 0 giving m = 1 below the line. The two agree for every
setting our trainer accepts (--mscale-all-dim 0 needs --mscale 1). An explicit
attention_factor that differs from the computed one, and truncate false (an unrounded
correction range), have no flag of ours: from-hf refuses them. Other rope types
(dynamic, longrope, ...) and partial_rotary_factor < 1 are refused too.
"""

from __future__ import annotations

import math

from hf_errors import ConvertError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys a rope_parameters dict of each type may carry (transformers' own validation lists).
_KEYS = {"default": set(), "linear": {"factor"},
         "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings"},
         "yarn": {"factor", "original_max_position_embeddings", "attention_factor",
                  "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}}


def rope_to_hf(cfg) -> dict:
    """transformers' rope_parameters for our ModelConfig `cfg` (a RoPE model)."""
    params = {"rope_theta": cfg.rotary_base}
    kind = cfg.rope_scaling
    if kind == "linear":
        params["factor"] = cfg.rotary_seq_len_interpolation_factor
    elif kind == "llama3":
        params.update(factor=cfg.rope_scaling_factor,
                      low_freq_factor=cfg.rope_scaling_low_freq_factor,
                      high_freq_factor=cfg.rope_scaling_high_freq_factor,
                      original_max_position_embeddings=cfg.original_max_positions)
    elif kind == "yarn":
        params.update(factor=cfg.rotary_scaling_factor,
                      original_max_position_embeddings=cfg.original_max_positions)
        # transformers' defaults left out, as its own configs leave them
        for key, value, default in (("beta_fast", cfg.yarn_beta_fast, 32.0),
                                    ("beta_slow", cfg.yarn_beta_slow, 1.0)):
            if value != default:
                params[key] = value
        if cfg.mscale and cfg.mscale_all_dim:  # else transformers' default, m(factor, 1)
            params.update(mscale=cfg.mscale, mscale_all_dim=cfg.mscale_all_dim)
    return {"rope_type": kind or "default", **params}


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def hf_attention_factor(p: dict, factor: float) -> float:
    """The YaRN attention factor transformers computes from rope_parameters `p`."""
    if p.get("mscale") and p.get("mscale_all_dim"):
        return _mscale(factor, p["mscale"]) / _mscale(factor, p["mscale_all_dim"])
    return _mscale(factor, 1.0)


def rope_from_hf(p: dict, max_positions: int, path: str, key: str) -> dict:
    """Our ModelConfig fields for transformers' rope_parameters `p` (standardized: it has
    rope_type and rope_theta); ConvertError naming the file `path` and its `key`
    (rope_parameters or rope_scaling) for what we cannot compute."""
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConvertError(path, f"{key}: rope_type {kind!r} is not supported (only "
                                 f"{', '.join(ROPE_TYPES)})")
    extra = sorted(set(p) - _KEYS[kind] - {"rope_type", "type", "rope_theta",
                                           "partial_rotary_factor"})
    if extra:  # a key transformers would warn about and ignore: say so rather than guess
        raise ConvertError(path, f"{key}: {kind}: unexpected key {extra[0]!r}")
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConvertError(path, f"{key}: partial_rotary_factor "
                                 f"{p['partial_rotary_factor']}: only full-head RoPE (1.0)")
    out = {"rotary_base": float(p["rope_theta"])}
    if kind == "linear":
        out["rotary_seq_len_interpolation_factor"] = float(p["factor"])
    elif kind == "llama3":
        out.update(use_rope_scaling=True, rope_scaling_factor=float(p["factor"]),
                   rope_scaling_low_freq_factor=float(p["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(p["high_freq_factor"]),
                   original_max_position_embeddings=int(p["original_max_position_embeddings"]))
    elif kind == "yarn":
        out.update(_yarn_from_hf(p, max_positions, path, key))
    return out


def _yarn_from_hf(p: dict, max_positions: int, path: str, key: str) -> dict:
    original = int(p.get("original_max_position_embeddings") or max_positions)
    factor = p.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    if p.get("truncate", True) is not True:
        raise ConvertError(path, f"{key}: yarn: truncate false (an unrounded correction "
                                 "range) is not supported: our YaRN rounds it, as "
                                 "transformers does by default")
    computed = hf_attention_factor(p, factor)
    given = p.get("attention_factor")
    if given is not None and not math.isclose(given, computed, rel_tol=1e-9):
        raise ConvertError(path, f"{key}: yarn: attention_factor {given} differs from "
                                 f"the one computed from factor, mscale and mscale_all_dim "
                                 f"({computed}); we have no flag for an explicit one")
    both = bool(p.get("mscale") and p.get("mscale_all_dim"))
    return {"rope_type": "yarn", "rotary_scaling_factor": factor,
            "original_max_position_embeddings": original,
            "yarn_beta_fast": float(p.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(p.get("beta_slow") or 1.0),
            "mscale": float(p["mscale"]) if both else 1.0,
            "mscale_all_dim": float(p["mscale_all_dim"]) if both else 0.0}


def rope_flags(cfg) -> list:
    """pretrain_gpt.py flags for the scaling of `cfg` (none for plain RoPE)."""
    kind = cfg.rope_scaling
    if kind == "linear":
        return ["--rotary-seq-len-interpolation-factor",
                repr(cfg.rotary_seq_len_interpolation_factor)]
    if kind == "llama3":
        return ["--use-rope-scaling", "--rope-scaling-factor", repr(cfg.rope_scaling_factor),
                "--rope-scaling-low-freq-factor", repr(cfg.rope_scaling_low_freq_factor),
                "--rope-scaling-high-freq-factor", repr(cfg.rope_scaling_high_freq_factor),
                "--original-max-position-embeddings", str(cfg.original_max_positions)]
    if kind == "yarn":
        return ["--rope-type", "yarn", "--rotary-scaling-factor",
                repr(cfg.rotary_scaling_factor), "--original-max-position-embeddings",
                str(cfg.original_max_positions), "--yarn-beta-fast", repr(cfg.yarn_beta_fast),
                "--yarn-beta-slow", repr(cfg.yarn_beta_slow), "--mscale", repr(cfg.mscale),
                "--mscale-all-dim", repr(cfg.mscale_all_dim)]
    return []
