"""The model's arithmetic: FLOPs of a training iteration, from the config alone (the
trainer's MFU and the planner's time model both count by it)."""

from __future__ import annotations

from megaulysses.config import ModelConfig
from megaulysses.model.attention import mask_from_config


def flops_per_iteration(m: ModelConfig, global_batch_size: int) -> float:
    """Megatron-LM's count for one training iteration (forward + backward = 3x forward).

    Per token and layer, forward multiply-adds: attention projections h*(q + 2 kv + q)
    head channels, scores and weighted sum 2*s*q (full s x s, as Megatron counts, for dense
    causal attention), MLP h*f*(3 if gated else 2); plus the logit layer h*V once.
    FLOPs = 2 x MACs. A sliding window or a block-sparse layout scales the scores term by
    the blocks it computes over those dense causal attention computes
    (AttentionMask.attended_fraction), so sparse runs are not credited with work they skip.
    Packed documents are counted as dense (their blocks depend on the data, as in Megatron).
    """
    h, s, L = m.hidden_size, m.seq_length, m.num_layers
    q = m.num_attention_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    attended = mask_from_config(m).attended_fraction(s)
    attn = h * (2 * q + 2 * kv) + 2 * s * q * attended
    mlp = h * m.ffn_size * (3 if m.swiglu else 2)
    macs_per_token = L * (attn + mlp) + h * m.padded_vocab_size
    return 3 * 2 * macs_per_token * s * global_batch_size
