"""Rotary position embedding: the angles of the positions, with the RoPE scalings, and the
rotation of q and k.

The scalings (config/schema_rope.py) are transformers' ROPE_INIT_FUNCTIONS
(modeling_rope_utils.py: "llama3", "linear", "yarn"), formula for formula: each changes
the inverse frequencies, and YaRN also multiplies cos and sin by an attention factor.

Computed in fp32, in transformers' order of operations, as transformers, Megatron-LM and
Meta's reference all compute them: the open models were trained with these fp32 angles,
whose rounding error grows with the position (about 6e-4 rad at 8K, 7e-8 per position), so
exact fp64 angles would be another function from the one the weights learned (logits
apart by 2e-4 at 8K). Every grid and every position gets the same values: they depend on
the global position only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from megaulysses.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig,
                        device: Optional[torch.device] = None) -> torch.Tensor:
    """The rotation speed of each dimension pair `[d/2]` fp32 (radians per position), with
    the model's RoPE scaling applied."""
    d, base = cfg.head_dim, cfg.rotary_base
    plain = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    scaling = cfg.rope_scaling
    if scaling == "linear":  # positions / factor, as Megatron-LM scales them
        factor = cfg.rotary_seq_len_interpolation_factor
        assert factor is not None  # the factor given is what selects "linear"
        return plain / factor
    if scaling == "llama3":
        return _llama3(plain, cfg)
    if scaling == "yarn":
        return _yarn(cfg, device)
    return plain


def _llama3(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths longer than original/low_freq_factor divided by the
    factor, shorter than original/high_freq_factor kept, a linear blend between."""
    factor, context = cfg.rope_scaling_factor, cfg.original_max_positions
    assert context is not None  # llama3's default fills it
    low, high = cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [d/2]
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)  # 0 at the long end, 1 at the short
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def _yarn(cfg: ModelConfig, device: Optional[torch.device]) -> torch.Tensor:
    """YaRN: dimension pairs that turn more than beta_fast times over the original context
    keep their frequency (extrapolation), those turning fewer than beta_slow times are
    divided by the factor (interpolation), a linear ramp between; the ramp's ends are
    rounded outwards to whole dimensions (transformers' truncate=True, Megatron-LM's)."""
    d, base, factor = cfg.head_dim, cfg.rotary_base, cfg.rotary_scaling_factor
    context = cfg.original_max_positions
    assert context is not None  # yarn's default fills it

    def dim_of(turns: float) -> float:  # the dimension that turns `turns` times over context
        return d * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(cfg.yarn_beta_fast)), 0)
    high: float = min(math.ceil(dim_of(cfg.yarn_beta_slow)), d - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - low)
            / (high - low)).clamp(0, 1)  # [d/2]: 0 keeps the frequency, 1 interpolates
    keep = 1 - ramp  # fp32 in transformers' order: 1 - (1 - keep) need not be keep
    freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    return 1.0 / (factor * freqs) * (1 - keep) + 1.0 / freqs * keep


def attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's mscale, 1 for the other scalings.
    transformers' rule: both mscales non-zero, their ratio; else 0.1*ln(factor) + 1. The
    config's rules keep --mscale at 1 when --mscale-all-dim is 0, where Megatron-LM's
    ratio gives the same."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    factor = cfg.rotary_scaling_factor

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if cfg.mscale and cfg.mscale_all_dim:
        return mscale(cfg.mscale) / mscale(cfg.mscale_all_dim)
    return mscale(1.0)


def rotary_angles(position_ids: torch.Tensor,
                  cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[b, s, 1, d/2]` fp32 of the rotary angles of `position_ids` `[b, s]`,
    times the scaling's attention factor.

    Computed from the positions themselves (fp32 position times fp32 inverse frequency:
    the values a table of every position would hold, bit for bit), so no rank keeps a
    `[max positions, d/2]` table: at a million positions that table is 256 MiB per rank, and a rank needs only
    its own tokens' angles. Position ids are global token positions: under sequence
    parallelism a rank holding tokens [r*S/P, (r+1)*S/P) passes those, never local ones.
    """
    inv_freq = inverse_frequencies(cfg, position_ids.device)  # [d/2]
    angles = position_ids.float().unsqueeze(-1) * inv_freq  # [b, s, d/2]
    cos, sin = angles.cos(), angles.sin()
    scale = attention_factor(cfg)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.unsqueeze(2), sin.unsqueeze(2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k `[b, s, h, d]` by the angles `cos`, `sin` `[b, s, 1, d/2]`
    (`rotary_angles`). Rotate-half layout (pairs i and i + d/2), as in Megatron-LM and
    Hugging Face Llama."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [b, s, h, d/2] each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
