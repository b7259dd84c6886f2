"""The RoPE scalings' settings: a frozen dataclass ModelConfig inherits (the fields stay
flat, `cfg.model.rope_type`), declared with the same `option(...)` as schema.py and listed
in --help under a group of their own after the model's flags.

Three ways to stretch a RoPE model's positions over a longer context, at most one at a
time, each computed by model/rope.py exactly as transformers' ROPE_INIT_FUNCTIONS does
("llama3", "linear", "yarn"), under Megatron-LM's flag names where it has them:

- llama3 (Llama 3.1/3.2/3.3): --use-rope-scaling; frequencies whose wavelength exceeds
  the original context / low-freq factor are divided by the factor, those shorter than
  the original context / high-freq factor kept, those between blended;
- linear position interpolation: --rotary-seq-len-interpolation-factor F, positions / F;
- YaRN: --rope-type yarn with --rotary-scaling-factor, the beta bounds of its ramp and
  an attention factor (mscale) that multiplies cos and sin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaulysses.config.fields import option
from megaulysses.config.groups import ROPE

LLAMA3_ORIGINAL_CONTEXT = 8192  # Megatron-LM's fixed value for --use-rope-scaling
ROPE_TYPES = ("rope", "yarn")


@dataclass(frozen=True)
class RopeScalingConfig:
    use_rope_scaling: bool = option(
        False, "Llama 3.x RoPE scaling (transformers' rope_type llama3): long wavelengths "
        "divided by --rope-scaling-factor, short ones kept, those between blended",
        action="store_true", group=ROPE)
    rope_scaling_factor: float = option(
        8.0, "--use-rope-scaling: the factor long wavelengths are stretched by, > 0",
        kind="number", group=ROPE)
    rope_scaling_low_freq_factor: float = option(
        1.0, "--use-rope-scaling: wavelengths above the original context / this are scaled "
        "fully, > 0", kind="number", group=ROPE)
    rope_scaling_high_freq_factor: float = option(
        4.0, "--use-rope-scaling: wavelengths below the original context / this are kept, "
        "> --rope-scaling-low-freq-factor", kind="number", group=ROPE)
    original_max_position_embeddings: Optional[int] = option(
        None, "--use-rope-scaling or --rope-type yarn: the pretraining context they scale "
        f"from; default: {LLAMA3_ORIGINAL_CONTEXT} for --use-rope-scaling (Megatron-LM's), "
        "--max-position-embeddings for yarn (transformers')", kind="positive", group=ROPE)
    rotary_seq_len_interpolation_factor: Optional[float] = option(
        None, "linear position interpolation (transformers' rope_type linear): positions "
        "divided by this, > 0", kind="number", group=ROPE)
    rope_type: Optional[str] = option(
        None, "yarn: YaRN scaling by --rotary-scaling-factor; rope: plain RoPE (as none)",
        choices=ROPE_TYPES, group=ROPE)
    rotary_scaling_factor: float = option(
        1.0, "--rope-type yarn: the context extension factor, >= 1", kind="number",
        group=ROPE)
    yarn_beta_fast: float = option(
        32.0, "--rope-type yarn: dimensions rotating more than this many times over the "
        "original context keep their frequency, > --yarn-beta-slow", kind="number",
        group=ROPE)
    yarn_beta_slow: float = option(
        1.0, "--rope-type yarn: dimensions rotating fewer times than this are interpolated "
        "fully, > 0", kind="number", group=ROPE)
    mscale: float = option(
        1.0, "--rope-type yarn: cos and sin are scaled by (0.1*mscale*ln(factor) + 1) / "
        "(0.1*mscale_all_dim*ln(factor) + 1), > 0", kind="number", group=ROPE)
    mscale_all_dim: float = option(
        0.0, "--rope-type yarn: see --mscale, >= 0; with 0, --mscale must be 1 (the factor "
        "is then 0.1*ln(factor) + 1, where transformers and Megatron-LM agree)",
        kind="number", group=ROPE)

    @property
    def rope_scaling(self) -> Optional[str]:
        """The scaling in effect, by transformers' rope_type name: "llama3", "linear",
        "yarn", or None (plain RoPE). The rules allow at most one."""
        if self.use_rope_scaling:
            return "llama3"
        if self.rotary_seq_len_interpolation_factor is not None:
            return "linear"
        if self.rope_type == "yarn":
            return "yarn"
        return None

    @property
    def max_positions(self) -> int:
        """The longest sequence: ModelConfig's (this mixin has no length of its own)."""
        raise NotImplementedError("ModelConfig defines max_positions")

    @property
    def original_max_positions(self) -> Optional[int]:
        """The context llama3 or yarn scales from (their defaults filled); None otherwise."""
        scaling = self.rope_scaling
        if scaling == "llama3":
            return self.original_max_position_embeddings or LLAMA3_ORIGINAL_CONTEXT
        if scaling == "yarn":
            return self.original_max_position_embeddings or self.max_positions
        return None

    def rope_shape_dict(self) -> dict:
        """The scaling's settings as a checkpoint records them: the original context with
        its default filled (a later run that changes --max-position-embeddings then sees
        yarn's original context change too), --rope-type rope as none."""
        return {"original_max_position_embeddings": self.original_max_positions,
                "rope_type": "yarn" if self.rope_type == "yarn" else None}
