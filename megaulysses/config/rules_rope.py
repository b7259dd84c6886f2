"""The rules of the RoPE scalings' flags (schema_rope.py); rules.validate runs them. Each
raises ConfigError(flag, rule), one line naming the flag."""

from __future__ import annotations

from dataclasses import fields

from megaulysses.config.errors import require
from megaulysses.config.schema_rope import RopeScalingConfig

# The flag that selects each scaling, for the messages.
_SWITCH = {"llama3": "--use-rope-scaling", "linear": "--rotary-seq-len-interpolation-factor",
           "yarn": "--rope-type yarn"}
# Each scaling's own parameters (fields of RopeScalingConfig).
_PARAMETERS = {"llama3": ("rope_scaling_factor", "rope_scaling_low_freq_factor",
                          "rope_scaling_high_freq_factor"),
               "yarn": ("rotary_scaling_factor", "yarn_beta_fast", "yarn_beta_slow", "mscale",
                        "mscale_all_dim")}


def validate_rope(m: RopeScalingConfig, position_embedding_type: str) -> None:
    """At most one scaling, on RoPE positions; each one's parameters in range; a
    parameter given without its scaling is refused (it would change nothing)."""
    chosen = [name for name, on in (("llama3", m.use_rope_scaling),
                                    ("linear", m.rotary_seq_len_interpolation_factor is not None),
                                    ("yarn", m.rope_type == "yarn")) if on]
    if not chosen:
        _parameters_need_their_scaling(m, None)
        return
    flag = _SWITCH[chosen[0]].split()[0]
    require(len(chosen) == 1, flag, f"cannot be combined with {_SWITCH[chosen[-1]]} (at most "
            "one RoPE scaling)")
    require(position_embedding_type == "rope", flag,
            f"scales RoPE: needs --position-embedding-type rope (got {position_embedding_type})")
    _parameters_need_their_scaling(m, chosen[0])
    if chosen[0] == "llama3":
        require(m.rope_scaling_factor > 0, "--rope-scaling-factor",
                f"must be > 0, got {m.rope_scaling_factor}")
        low, high = m.rope_scaling_low_freq_factor, m.rope_scaling_high_freq_factor
        require(low > 0, "--rope-scaling-low-freq-factor", f"must be > 0, got {low}")
        require(high > low, "--rope-scaling-high-freq-factor",
                f"must be > --rope-scaling-low-freq-factor {low}, got {high}")
    elif chosen[0] == "linear":
        factor = m.rotary_seq_len_interpolation_factor
        require(factor is not None and factor > 0, flag, f"must be > 0, got {factor}")
    else:
        _validate_yarn(m)


def _validate_yarn(m: RopeScalingConfig) -> None:
    require(m.rotary_scaling_factor >= 1, "--rotary-scaling-factor",
            f"YaRN's factor must be >= 1, got {m.rotary_scaling_factor}")
    require(m.yarn_beta_slow > 0, "--yarn-beta-slow", f"must be > 0, got {m.yarn_beta_slow}")
    require(m.yarn_beta_fast > m.yarn_beta_slow, "--yarn-beta-fast",
            f"must be > --yarn-beta-slow {m.yarn_beta_slow}, got {m.yarn_beta_fast}")
    require(m.mscale > 0, "--mscale", f"must be > 0, got {m.mscale}")
    require(m.mscale_all_dim >= 0, "--mscale-all-dim", f"must be >= 0, got {m.mscale_all_dim}")
    # transformers ignores both unless both are non-zero; Megatron-LM divides always: they
    # agree there and at the defaults only
    require(m.mscale_all_dim > 0 or m.mscale == 1.0, "--mscale",
            f"must be 1 when --mscale-all-dim is 0 (got {m.mscale}): transformers ignores "
            "it then")


def _parameters_need_their_scaling(m: RopeScalingConfig, chosen) -> None:
    """A scaling's parameter set away from its default without that scaling."""
    defaults = {f.name: f.default for f in fields(RopeScalingConfig)}
    for scaling, names in _PARAMETERS.items():
        for name in names:
            require(scaling == chosen or getattr(m, name) == defaults[name],
                    "--" + name.replace("_", "-"),
                    f"needs {_SWITCH[scaling]} (it sets that scaling's parameter)")
    require(chosen in ("llama3", "yarn") or m.original_max_position_embeddings is None,
            "--original-max-position-embeddings", "needs --use-rope-scaling or --rope-type yarn")
