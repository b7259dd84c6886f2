"""Attention as data: `AttentionMask` says what each query may attend to; cores compute it.

Core protocol: `core(q, k, v, dropout_p=0.0, mask=None) -> out`, q `[b, s, hq, d]`, k and v
`[b, s, hkv, d]` with hq % hkv == 0 (GQA), out `[b, s, hq, d]`; `mask=None` is plain causal.
The layout is `[b, s, h, d]` on purpose: Ulysses re-shards exactly these tensors (sequence
<-> heads) around any core without the core knowing, and since each rank then holds the
whole sequence, the mask it passes on is the whole-sequence mask, unchanged.

A mask (mask.py) is stated in global token positions of the whole sample, so the ring of
`parallel/ring.py`, which holds other positions than 0..s-1, asks the same questions
(`allows`, `block_kinds`) with its own position lists.

Backends (`BACKENDS` in backends.py, the one list; `--attention-backend`):
    math   explicit scores, dense [s, s] mask, fp32 softmax: the reference; any mask
    block  by blocks of queries and keys, skipping blocks the mask excludes (flash-style
           backward, nothing [s, s] kept): any mask, dropout by a positional hash;
           `auto` on CPU
    sdpa   torch SDPA, causal only
    flash  the flash_attn package (CUDA, 16-bit): causal and window
    flex   torch flex_attention (CUDA): any mask, through a block mask

What a kernel derives from a mask once per batch (flex's block mask, flash's cu_seqlens)
is kept on the mask (`AttentionMask.prepared`): the GPT makes one mask per forward and
hands that same object to every layer and to recomputation, so the first layer builds it
and the others, and backward's recomputation, reuse it (no per-layer host syncs).

The modules, each importing only those above it:
    mask.py          AttentionMask, SparseLayout, the block kinds, mask_from_config
    dropout.py       AttentionDropout: the dropout mask as a hash of (key, sample, global
                     head, global query and key positions), the same however a grid cuts
                     the computation; `dropout_p` of a core is a float or one of these
    fused.py         fused kernels with log-sum-exp (flash-attn, torch's fused SDPA ops):
                     one call per step for plain causal or full masks
    block.py         the block kernel (masked_block_attention, the ring's partials, merge)
    block_causal.py  block_causal_attention: plain causal by query blocks, probabilities
                     kept for backward (CPU, moderate lengths)
    kernels.py       the cores: math, sdpa, block, cpu, flash, flex (and flex's block
                     masks, flash's varlen arguments)
    backends.py      Backend, BACKENDS, select_backend
"""

from megaulysses.model.attention.backends import (BACKEND_CHOICES, BACKENDS, Backend,
                                                  flash_available, mask_features,
                                                  select_backend)
from megaulysses.model.attention.block import (attention_block_size, computed_pairs,
                                               masked_block_attention)
from megaulysses.model.attention.dropout import AttentionDropout, as_dropout, dropout_prob
from megaulysses.model.attention.fused import fused_kernel
from megaulysses.model.attention.kernels import (CPU_BLOCK_MAX_SEQ, FLEX_BLOCK, AttentionCore,
                                                 block_attention, cpu_attention,
                                                 document_cu_seqlens, flash_attention,
                                                 flash_varlen_args, flex_attention,
                                                 flex_block_mask, math_attention,
                                                 sdpa_attention, sdpa_repeats_kv)
from megaulysses.model.attention.mask import (FULL, PARTIAL, SKIP, SPARSITIES, AttentionMask,
                                              SparseLayout, mask_from_config)

__all__ = [
    # mask.py
    "SPARSITIES", "SKIP", "PARTIAL", "FULL", "SparseLayout", "AttentionMask",
    "mask_from_config",
    # dropout.py
    "AttentionDropout", "as_dropout", "dropout_prob",
    # fused.py
    "fused_kernel",
    # block.py
    "attention_block_size", "computed_pairs", "masked_block_attention",
    # kernels.py
    "AttentionCore", "math_attention", "sdpa_attention", "sdpa_repeats_kv",
    "block_attention", "CPU_BLOCK_MAX_SEQ", "cpu_attention", "flash_attention",
    "flash_varlen_args", "document_cu_seqlens", "flex_attention", "FLEX_BLOCK",
    "flex_block_mask",
    # backends.py
    "Backend", "BACKENDS", "BACKEND_CHOICES", "flash_available", "mask_features",
    "select_backend",
]
