"""The memory plan's shapes: what this rank runs (`_RankLayout`) and the sizes its tensors
are made of (`_Shape`), from the config alone; the attention core it runs.

Notation, per rank: b micro-batch, S sequence, C = cp ring ranks, T = b*S/(sp*C) tokens of a
micro-batch on this rank, T' = T/tp between sublayers under Megatron-SP (else T), h hidden,
d head dim, hq and hkv the q and kv heads of this tensor-parallel rank (/tp), kv = hkv, or
max(hkv, sp) when Ulysses repeats kv heads, f = ffn/tp, V = padded vocabulary/tp, e = bytes
of the compute dtype (4; 2 under bf16/fp16 autocast), r = bytes of the residual stream (e;
4 under --fp32-residual-connection), 4 = fp32: the norms' outputs, rotary angles, softmax
statistics and every master parameter, gradient and AdamW state are fp32. The attention
core holds S/C positions of hq/sp heads: Q = T*hq*d elements of q (and of out), K = T*kv*d
of k (and v), lse = 4*b*(hq/sp)*S/C bytes of fp32 logsumexp.

Micro-batches in flight on pipeline rank r: 1f1b min(m, pp - r); gpipe m;
interleaved-1f1b torch's warm-up + 1 model chunks (a chunk keeps its share of the rank's
layers); zero-bubble (torch's ScheduleInterleavedZeroBubble, ZB1P) warm-up + 1 + r, which
is (chunks - 1) * per_round + pp on every rank: rank r runs a chunk's weight-gradient pass
(W) r input-gradient passes (B) after its B, and a chunk keeps its activations until its
W, so at a W r + 1 chunks are between B and W (`pending`), the others not backwarded yet.
Not modelled: zero-bubble under --recompute-granularity full, whose last-stage W pass
peaked 24 MiB above its start on test_memory_plan.py's pp2 model (1.5 MiB without).
Later backwards hold as many while forwards remain, and the gradients.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from megaulysses.config import Config, pipeline_layout
from megaulysses.config.fields import filled
from megaulysses.config.rules_memory import fpdt_chunks
from megaulysses.model.attention.block import attention_block_size
from megaulysses.model.attention.kernels import CPU_BLOCK_MAX_SEQ
from megaulysses.model.ops.cross_entropy import rows_per_chunk
from megaulysses.parallel.dims import ParallelDims

F32 = 4
LAYOUT_GRID_MAX = 4096  # sparse layouts of more blocks: a bound instead of the grid


# -- what this rank runs -------------------------------------------------------------------

@dataclass(frozen=True)
class _RankLayout:
    """The pipeline rank's stages and schedule, the ZeRO stage in effect."""

    ids: tuple  # pipeline stages on this rank
    stage_layers: tuple  # layers of each
    first: bool  # holds stage 0 (the embedding)
    last: bool  # holds the last stage (the head, the loss)
    m: int  # micro-batches per step
    in_flight: int  # micro-batches (model chunks) held at the first backward
    zero_stage: int
    pending: int = 0  # zero-bubble: of those, chunks between their B and W passes at a W

    @property
    def layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def chunks(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, cfg: Config, dims: ParallelDims, pp_rank: int) -> "_RankLayout":
        par, t = cfg.parallel, cfg.train
        layout = pipeline_layout(cfg.model.num_layers, par)
        ids = tuple(range(pp_rank, len(layout), dims.pp))
        m = filled(t.global_batch_size, "--global-batch-size") // (t.micro_batch_size * dims.dp)
        schedule = par.pipeline_schedule if dims.pp > 1 else None
        in_flight = _in_flight(schedule, dims.pp, pp_rank, m, len(ids))
        return cls(ids=ids, stage_layers=tuple(len(layout[i]) for i in ids), first=0 in ids,
                   last=len(layout) - 1 in ids, m=m, in_flight=in_flight,
                   # one such rank: no ZeRO, except --zero-param-offload's stage 3
                   # (FSDP2 over a world-1 group, parallelize.py)
                   zero_stage=par.zero_stage if _zero_ranks(dims) > 1
                   or par.zero_param_offload else 0,
                   pending=min(pp_rank + 1, in_flight) if schedule == "zero-bubble" else 0)


def _zero_ranks(dims: ParallelDims) -> int:
    """N: the ranks that reduce gradients and shard ZeRO's states (dp x cp x sp)."""
    return dims.dp * dims.cp * dims.sp


def _in_flight(schedule: Optional[str], pp: int, rank: int, m: int, chunks: int) -> int:
    """Micro-batches (model chunks, with virtual stages) whose activations this rank holds
    at its first backward (torch.distributed.pipelining's schedules)."""
    if schedule is None:
        return 1
    if schedule == "1f1b":
        return min(m, pp - rank)
    if schedule == "gpipe":
        return m
    per_round = m // max(1, m // pp)
    if schedule == "interleaved-1f1b":
        return min((chunks - 1) * per_round + 2 * (pp - 1 - rank) + 1, m * chunks)
    # zero-bubble: warm-up (chunks - 1) * per_round + pp - 1 - rank forwards, then each
    # forward's B, and the W of the B `rank` steps earlier: at a W, warm-up chunks not
    # backwarded yet and rank + 1 between B and W (module doc)
    return min((chunks - 1) * per_round + pp, m * chunks)


# -- shapes ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Shape:
    """The sizes this rank's tensors are made of (the module doc's notation)."""

    b: int
    S: int
    T: int
    Tr: int  # T': tokens between sublayers
    h: int
    d: int
    hq: int
    hkv: int
    kv: int  # kv heads reaching the core (Ulysses may repeat them)
    f: int
    V: int
    e: int  # bytes of the compute dtype
    r: int  # bytes of the residual stream's dtype
    tp: int
    sp: int
    cp: int  # C: ring ranks
    mega_sp: bool
    swiglu: bool
    rope: bool
    layernorm: bool
    hidden_dropout: bool
    kernel: str  # block | masked | ring | sdpa | fused | sdpa-math | math | fpdt
    ce_rows: int  # rows of a cross-entropy chunk
    block: int = 64  # masked / ring: the kernel's block of query (and key) positions
    mask_e: int = F32  # bytes of a hidden-dropout mask's element: CUDA's fused dropout
    # keeps a bool mask, CPU's a mask in the input's dtype (a sublayer's output: e)
    keys: int = 0  # masked / ring: the most keys one query block attends in one call
    # (the ring: at its first step, the rank's own keys)
    keys_later: int = 0  # the ring's later steps: the most keys of another rank's
    keys_arriving: int = 0  # ... at a later step while the next step's keys arrive
    documents: bool = False  # the batch carries packed documents' ids
    fused: bool = False  # ring, fpdt: every step (pair) on the fused kernel (plain causal)
    cp_rank: int = 0  # the ring rank planned
    qk_norm: bool = False  # --qk-layernorm: per-head norms of q and k
    groups: int = 1  # --attention-head-groups: the core runs by groups of heads (cores.py)
    selective: bool = False  # --recompute-activations (cores.py's head groups need it)
    chunks: int = 0  # --ds-sequence-parallel-fpdt: sequence chunks (chunked.py); 0: off
    attn_dropout: bool = False  # --attention-dropout > 0: the block kernels hash a mask
    # per query block (model/attention/dropout.py; cores.py's `_dropout_set`)
    fpdt_host: bool = False  # --ds-sequence-parallel-fpdt-offloading

    @property
    def embed_mask_e(self) -> int:
        """Bytes of the embedding dropout mask's element (its input: the residual stream)."""
        return 1 if self.mask_e == 1 else self.r

    @property
    def ce_kept(self) -> bool:
        """The fused cross entropy keeps its one chunk of exps for backward."""
        return self.T <= self.ce_rows

    @property
    def core_heads(self) -> int:
        return self.hq // self.sp

    @property
    def Sc(self) -> int:
        """The positions the attention core holds per sample: S, or S/C in the ring."""
        return self.S // self.cp

    @property
    def Q(self) -> int:
        """Elements of the core's q (and out): b * Sc * hq/sp * d = T*hq*d."""
        return self.T * self.hq * self.d

    @property
    def K(self) -> int:
        """Elements of the core's k (and v)."""
        return self.T * self.kv * self.d

    @property
    def rep(self) -> int:
        """q heads per kv head in the core."""
        return max(1, self.hq // self.kv)

    @property
    def lse(self) -> int:
        """Bytes of the core's fp32 logsumexp, [b, hq/sp, Sc]."""
        return F32 * self.b * self.core_heads * self.Sc

    def scores(self, keys: int, backward: bool = True) -> int:
        """Bytes of the one query block's scores alive at a time in the masked kernel or a
        ring step, a block of `keys` keys: forward its fp32 scores, backward its fp32
        probabilities P and dS at once; under autocast also a half-dtype matmul product or
        cast beside them, half a block more (measured). Per sample when packed documents
        make the samples' blocks differ."""
        one = F32 * (1 if self.documents else self.b) * self.core_heads * self.block * keys
        return one * (2 if backward else 1) + (one // 2 if self.e != F32 else 0)


def _shape(cfg: Config, dims: ParallelDims, device_type: str, cp_rank: int = 0) -> _Shape:
    m, t = cfg.model, cfg.train
    tp, sp, cp = dims.tp, dims.sp, dims.cp
    mega_sp = cfg.parallel.tp_sequence_parallel and tp > 1
    T = t.micro_batch_size * m.seq_length // (sp * cp)
    kernel = _kernel(cfg, dims, device_type)
    chunks = fpdt_chunks(m, cfg.memory) if kernel == "fpdt" else 0
    # attention dropout: the positional mask runs on the blocks, never the fused kernel
    fused = kernel in ("ring", "fpdt") and _fused(cfg, device_type) and not m.attention_dropout
    blocks = (_blocks(m, cp, cp_rank) if kernel in ("masked", "ring") and not fused
              else (64, 0, 0, 0))
    if chunks:  # parallel/fpdt.py: the block kernel's block divides a local chunk
        from megaulysses.model.attention import mask_from_config
        layout = mask_from_config(m).layout
        blocks = (attention_block_size(T // chunks, layout_block=layout.block if layout
                                       else None), _blocks(m, 1, 0)[1], 0, 0)
    hkv = m.num_kv_heads // tp
    V = m.padded_vocab_size // tp
    e = 2 if t.bf16 or t.fp16 else F32
    return _Shape(b=t.micro_batch_size, S=m.seq_length, T=T, Tr=T // tp if mega_sp else T,
                  h=m.hidden_size, d=m.head_dim, hq=m.num_attention_heads // tp, hkv=hkv,
                  kv=max(hkv, sp) if sp > 1 and hkv % sp else hkv, f=m.ffn_size // tp, V=V,
                  e=e, r=F32 if m.fp32_residual_connection else e, tp=tp, sp=sp, cp=cp,
                  mega_sp=mega_sp,
                  swiglu=m.swiglu, rope=m.position_embedding_type == "rope",
                  layernorm=m.normalization == "LayerNorm", hidden_dropout=m.hidden_dropout > 0,
                  mask_e=1 if device_type == "cuda" else e,
                  qk_norm=m.qk_layernorm, groups=cfg.memory.attention_head_groups,
                  selective=cfg.memory.recompute_granularity == "selective",
                  chunks=chunks, fpdt_host=bool(chunks) and
                  cfg.memory.ds_sequence_parallel_fpdt_offloading,
                  kernel=kernel, block=blocks[0], keys=blocks[1], keys_later=blocks[2],
                  keys_arriving=blocks[3],
                  documents=cfg.data.reset_attention_mask, fused=fused, cp_rank=cp_rank,
                  ce_rows=rows_per_chunk(T, V, device_type),
                  attn_dropout=m.attention_dropout > 0)


def _describe(s: _Shape) -> str:
    """The attention core of the plan, in words (for the table)."""
    names = {"block": "CPU query-block kernel (causal, keeps probabilities)",
             "masked": "block kernel", "ring": f"ring over cp {s.cp}, block kernel",
             "sdpa": "SDPA / flash (keeps the logsumexp)",
             "fused": "block backend, plain causal: fused kernel (keeps the logsumexp)",
             "sdpa-math": "SDPA math path (dropout)", "math": "math (explicit scores)"}
    if s.kernel == "fpdt":
        kernel = "fused kernel" if s.fused else f"block kernel, blocks of {s.block}"
        return (f"Ulysses in {s.chunks} sequence chunks (FPDT), {kernel}"
                f"{', kept on the host' if s.fpdt_host else ''}")
    if s.fused:
        return f"ring over cp {s.cp}, fused kernel (with lse, one call a step)"
    words = names[s.kernel]
    if s.kernel in ("masked", "ring"):
        words += (f", blocks of {s.block}, <= {max(s.keys, s.keys_later)} keys a query "
                  "block")
    return words


def _masked(cfg: Config) -> bool:
    """A mask other than plain causal: window, block-sparse layout or packed documents."""
    m = cfg.model
    return (m.window_size is not None or m.attention_sparsity != "dense"
            or cfg.data.reset_attention_mask)


def _fused(cfg: Config, device_type: str) -> bool:
    """A plain causal mask that model/attention/fused.py has a kernel for: CPU (fp32,
    16-bit), CUDA with head dim a multiple of 8 up to 256."""
    d = cfg.model.head_dim
    return not _masked(cfg) and (device_type == "cpu" or (d % 8 == 0 and d <= 256))


def _kernel(cfg: Config, dims: ParallelDims, device_type: str) -> str:
    """The attention core `select_backend`, `cpu_attention` and the ring run. Attention
    dropout: the block kernel (its positional mask; never the fused one) on CPU under
    `auto` or `block`, and on CUDA under `auto` for masks flash cannot run (flex has no
    dropout; flash is assumed installed for 16-bit); SDPA's math path on CPU under
    `sdpa`."""
    m, half = cfg.model, cfg.train.bf16 or cfg.train.fp16
    drop = m.attention_dropout > 0
    if dims.cp > 1:
        return "ring"  # parallel/ring.py, whatever the backend (and inside Ulysses)
    if cfg.memory.ds_sequence_parallel_fpdt:  # at sp = 1 too (no exchange, the chunks alone)
        return "fpdt"  # parallel/fpdt.py: chunked, on the block kernel (planner/chunked.py)
    if m.attention_backend == "math":
        return "math"
    if m.attention_backend == "block" and _fused(cfg, device_type) and not drop:
        return "fused"  # the block backend's fused kernel: q, k, v, out, lse, as SDPA
    auto = m.attention_backend == "auto"
    cuda_blocks = drop and _masked(cfg) and (not half or m.attention_sparsity != "dense")
    if m.attention_backend == "block" or (auto and device_type == "cpu" and (
            _masked(cfg) or drop)) or (auto and device_type == "cuda" and cuda_blocks):
        return "masked"  # model/attention/block.py: masked_block_attention
    if m.attention_backend in ("flash", "flex"):
        return "sdpa"  # both keep q, k, v, out and the logsumexp
    if (device_type == "cpu" and m.attention_backend == "auto" and not half
            and m.attention_dropout == 0 and m.seq_length <= CPU_BLOCK_MAX_SEQ):
        return "block"
    if device_type == "cpu" and m.attention_dropout > 0:
        return "sdpa-math"  # CPU SDPA has no fused kernel with dropout
    return "sdpa"  # torch SDPA or flash_attn: both keep the logsumexp only


def _blocks(m, cp: int, cp_rank: int) -> tuple[int, int, int, int]:
    """(block, keys, keys_later, keys_arriving) of the block kernel
    (model/attention/block.py): its block of positions (ring: over the S/(2C) positions of a
    zigzag chunk) and the most keys one query block attends in one call, by the static
    mask: over the whole sequence; the ring's first step (the rank's own S/C keys), its
    later steps (another rank's: ring rank c's late chunk attends all S/C of a later rank,
    c < C-1, both chunks of the last S/(2C) of an earlier one), and its later steps while
    the next step's keys arrive (all but the last; 0 where none, C = 2). Sparse layouts:
    bounded by their most attended blocks."""
    from megaulysses.model.attention import mask_from_config
    from megaulysses.model.attention.block import attention_block_size
    S = m.seq_length
    layout = mask_from_config(m).layout
    layout_block = layout.block if layout is not None else None
    chunk = S // (2 * cp)
    block = attention_block_size(chunk if cp > 1 else S, layout_block=layout_block)
    bound = S
    if layout is not None:  # a layout block attended: all its positions
        bound = _layout_blocks_attended(layout, S // layout.block) * layout.block
    if cp == 1:
        if m.window_size is not None:  # keys (i - w, i] of a block's rows
            bound = min(bound, (-(-(m.window_size - 1) // block) + 1) * block)
        return block, min(bound, S), min(bound, S), 0
    steps = [min(bound, k) for k in _ring_keys(S, cp, cp_rank, block, m.window_size)]
    return block, steps[0], max(steps[1:]), max(steps[1:-1], default=0)


@functools.lru_cache(maxsize=1024)  # pure; the grid search asks the same lengths often
def _ring_keys(S: int, cp: int, rank: int, block: int, window: Optional[int]) -> tuple:
    """Per ring step, the most keys (in whole blocks) one of ring rank `rank`'s query
    blocks attends among the keys it holds then, under the causal mask and the window:
    block pairs by their position ranges, as `AttentionMask.block_kinds` skips them."""
    chunk = S // (2 * cp)

    def chunks(r):  # zigzag: chunks r and 2C-1-r
        return ((r * chunk, (r + 1) * chunk), ((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))

    starts = [a for lo, hi in chunks(rank) for a in range(lo, hi, block)]
    keys = []
    for step in range(cp):
        most = 0
        for a in starts:  # rows a .. a+B-1 see keys max(0, a-w+1) .. a+B-1
            lo, hi = (0 if window is None else max(0, a - window + 1)), a + block - 1
            n = 0
            for k_lo, k_hi in chunks((rank - step) % cp):
                first, last = max(k_lo, lo), min(k_hi - 1, hi)
                if last >= first:
                    n += last // block - first // block + 1
            most = max(most, n * block)
        keys.append(most)
    return tuple(keys)


def _layout_blocks_attended(layout, n: int) -> int:
    """The most layout blocks one query block attends (over n blocks): from the layout's
    grid, or beyond LAYOUT_GRID_MAX blocks its rule's bound."""
    if n <= LAYOUT_GRID_MAX:
        return int(layout.blocks(n).sum(dim=1).max())
    if layout.kind == "bigbird":
        return min(n, layout.local + layout.global_ + layout.random)
    return min(n, layout.local + layout.global_ * (n // layout.local))
