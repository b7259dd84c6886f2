"""The memory plan: bytes per rank of one pipeline stage, predicted from the config alone.

`plan_memory(cfg, dims, pp_rank)` is arithmetic: no tensor is allocated and no process
group is needed (the GPT is built on the meta device to list the stage's parameters). It
describes *this* implementation: what autograd saves in model/gpt.py, layers.py and
ops/ and attention/, what ZeRO (zero.py, comm.GradReducer, FSDP2) and torch's pipeline schedules
hold, and when. `pretrain_gpt.py --dry-run` prints it for every stage, the trainer logs
it at start-up, and tests/parallel/test_memory_plan.py holds it to within 10% of the live
tensor bytes real ranks reach (and its communication bytes to what they send).

Notation, per rank: b micro-batch, S sequence, C = cp ring ranks, T = b*S/(sp*C) tokens of a
micro-batch on this rank, T' = T/tp between sublayers under Megatron-SP (else T), h hidden,
d head dim, hq and hkv the q and kv heads of this tensor-parallel rank (/tp), kv = hkv, or
max(hkv, sp) when Ulysses repeats kv heads, f = ffn/tp, V = padded vocabulary/tp, e = bytes
of the compute dtype (4; 2 under bf16/fp16 autocast), 4 = fp32: the residual stream, norms,
rotary angles, softmax statistics and every master parameter, gradient and AdamW state are
fp32. The attention core holds S/C positions of hq/sp heads: Q = T*hq*d elements of q (and
of out), K = T*kv*d of k (and v), lse = 4*b*(hq/sp)*S/C bytes of fp32 logsumexp.

Activations a layer keeps for backward, bytes (each term by name in `layer_terms`):
    attn norm    RMSNorm (fused): x_hat 4*T'*h + rstd 4*T' (LayerNorm: input, mean, rstd)
    attn input   the normed input q, k, v save: one fp32 tensor 4*T*h (Megatron-SP: the
                 all-gathered whole one); under autocast each linear's e-byte copy, 3*e*T*h
    core         recompute none, CPU block kernel (fp32, no dropout, S <= 1024): q*scale,
                 k, v, out, 4*T*(2hq + 2kv)*d, and the causal probabilities: fp32, per
                 (sample, core head) the sum over query blocks of 64 rows of rows*keys,
                 ~S*(S+64)/2, core heads hq/sp; SDPA / flash: q, k, v, out, e*T*(2hq +
                 2kv)*d, and the fp32 logsumexp b*(hq/sp)*S; CPU SDPA with dropout (its
                 math path): q, k, v + three fp32 S*S per head (probabilities, mask,
                 dropped); the block kernel of model/attention/block.py (any mask but plain
                 causal on CPU, --attention-backend block): q, k, v, out, e*(2Q + 2K), and
                 lse -- no probabilities (plain causal there runs the fused kernel of
                 model/attention/fused.py, which keeps the same, as SDPA); the ring (cp > 1,
                 parallel/ring.py, inside Ulysses) the same (its output merged in fp32,
                 saved in q's dtype), on either kernel;
                 selective: only the core's inputs (the checkpoint), e*T*(hq +
                 2kv)*d -- everything else is recomputed in backward
    out input    the out-projection's input, e*T*hq*d (none without Ulysses when it is the
                 core's saved output: SDPA's, the block kernel's and the ring's, all laid
                 out [b, s, h, d], contiguous)
    mlp norm     as attn norm
    mlp input    as attn input, for fc1 and gate (2 copies under autocast; GeLU: 1)
    mlp hidden   SwiGLU: gate out, silu out, fc1 out, their product, 4*e*T*f (GeLU: 2)
    dropout      with --hidden-dropout: two fp32 masks, 2 * 4*T'*h
  --tiled-mlp-chunks N > 1: mlp norm, input and hidden give way to the MLP's input (the
    residual stream, 4*T'*h) that the per-chunk checkpoints keep.
  --recompute-granularity full: a checkpointed group keeps its input, 4*T'*h; method
    block: the first --recompute-num-layers layers of a stage one by one, the rest keep
    everything.
Outside the layers, per micro-batch: RoPE's cos and sin for the micro-batch's positions,
computed once per forward and shared by every layer, 2 * 4*T*d/2; the last stage keeps
the final norm (4*T'*h), the loss's input (e*T*h; under autocast also its e-byte copy of
the output weight, e*V*h), ~25 bytes a token of statistics and, when the fused cross
entropy has one chunk (T*V <= 2^23 elements on CPU, 2^28 on CUDA), its exps 4*T*V; a
non-last pipeline stage keeps its output (4*T'*h) until the micro-batch's backward; the
first stage under tp the lookup's mask and ids (~9 bytes a token), with dropout the
embedding's mask (4*T'*h).

Micro-batches in flight on pipeline rank r: 1f1b min(m, pp - r); gpipe m;
interleaved-1f1b torch's warm-up + 1 model chunks (a chunk keeps its share of the rank's
layers); zero-bubble warm-up + 2 (a chunk lives until its weight-gradient pass;
measured). Later backwards hold as many while forwards remain, and the gradients.

Model states, per rank (rank 0 of dp x cp x sp): P = fp32 bytes of its parameters (its
stage, its tp shard); ZeRO over N = dp*cp*sp (the ranks that see different tokens) cuts each
along dim 0 into ceil(rows/N)-row pieces.
    parameters  stage 0/1: P; 2/3: the padded piece;
                + autocast's cached e-byte copies of the blocks' weights (stages 0/1);
                + FSDP's gathered copies (compute dtype): stage 2 (and 2/3 under pp)
                everything, stage 3 the root unit (embedding, final norm, output layer)
                and one block at the loss's backward, two (this one and the prefetched
                one) during a block's backward
    gradients   stage 0/1 (and 2/3 under pp) P from a step's first backward on, in place;
                stage 2/3 the piece, plus a block's unsharded gradients during its
                backward; the last layer's fresh gradients in a step's first backward
    optimizer   AdamW's two fp32 moments of the rank's rows + 4 bytes of step per tensor
    reduction   stage 0: a flat copy of every 25 MiB bucket (--grad-reduce-dtype) until
                all all-reduces end, + P; stage 1: earlier buckets in flight, the last
                one's gradients, padded pieces and their concatenation; at the step the
                reduced rows and the all-gather of the updated rows (N pieces); FSDP: a
                block's reduce-scatter input (padded, reduce dtype) beside its gradients
    pipeline    torch's receive buffers, one per micro-batch and direction (4*T'*h each);
                the step's micro-batches (28 bytes a token; with packed documents also
                their int32 ids of the whole samples, 4*b*S, on every rank), twice under
                pp (concatenated)

The peak is the largest of these moments (the table shows which):
    head backward        the loss's backward, everything kept alive: its dW^T accumulator
                         (4*h*V), the input gradient (e*T*h) and the largest of a chunk's
                         dW product, two chunks of exps (the next recomputed while the
                         last is still referenced; e+4 bytes each under autocast), the
                         final e-byte dW
    mlp backward         the last layer's MLP backward: two e*T*f gradients beyond what it
                         keeps and the residual stream's gradient (on the last stage also
                         the loss's input gradient, 4*T'*h, still referenced; under
                         Megatron-SP fc2's gradient all-gathered, 4*T*h, per chunk when
                         tiled); what recomputation brings back (full: the group's layers
                         in full, while earlier groups keep their inputs; tiled: one chunk
                         of the MLP, and the chunks' input gradients, 4*T'*h in all); a
                         tied embedding's gradient waiting for the embedding's own backward
    core backward        the last layer's attention core backward, the MLP freed: the
                         core's gradients (block kernel: two 64-row gradient blocks; and
                         under selective recomputation the core's internals again); the
                         masked block kernel and the ring below
    qkv backward         q, k and v's input gradients summed, the core's freed: dq, dk, dv
                         and three 4*T*h tensors at once under tensor parallelism (DTensor
                         adds out of place; Megatron-SP: T is the whole sequence), two
                         without
    attention recomputed (full recomputation under Ulysses, or with the masked kernel or
                         the ring) the last layer rerunning its attention: q, k, v before
                         the all-to-all (the caller still holds them) beside those after
                         it, and the output all-to-all's packing or the core's forward
                         working set (below)
    FSDP (stages 2/3, no pp): after the head's backward its unsharded gradients wait for the
                         root unit's reduce-scatter at the end of backward (all moments)
    block reduce-scatter (stages 2/3) right after the last layer's backward
    reduction, step      stage 0/1's buckets, stage 1's all-gather (activations freed)

The block kernel's and the ring's working sets (measured, tests/parallel/test_memory_plan.py;
"a block": one query block's fp32 scores over the most keys it attends in one call, by the
static mask -- causal: all S; window w: (ceil((w-1)/B) + 1)*B for blocks of B; the ring per
step, from the zigzag chunks' positions (`_ring_keys`): ring rank c < C-1 meets a later
rank's S/C keys, all attended by its late chunk, the last rank S/(2C) per later step
(`plan_memory(cp_rank=...)`); a sparse layout: its most attended blocks -- per sample with
packed documents. One block is alive at a time (each is dropped before the next): forward
its scores, backward its P and dS; under autocast also half a block, a half-dtype matmul
product or cast beside them; plus the block's element mask, a byte per score):
    masked backward      dout; q scaled, k, v grouped (copies), dout grouped under GQA,
                         e*(Q + 2K (+ Q)); fp32 dq, dk, dv, 4*(Q + 2K), accumulated in
                         their returned layout; a block; row statistics
    masked forward       q scaled, k, v grouped, a block; the output is written block by
                         block into the kept one (q's dtype, [b, s, hq, d])
    ring backward        the largest of its first step, a later one and a later one with
                         keys arriving: dout (its fp32 copy under autocast); the step's
                         partial_backward (q scaled, k, v grouped, dout grouped in fp32
                         under GQA, its fp32 dq, dk, dv shares, a block); the keys and
                         values arriving for the next step (all steps but the last); later
                         steps also dq's accumulator, the step's received keys and values,
                         the last step's dk, dv shares in flight (sent as they are) and the
                         accumulators arriving, 4*4K
    ring forward         the largest of the same three steps: partial_forward's grouped
                         copies and a block, the running fp32 out (beyond the kept one,
                         e*Q, cast at the end), the keys and values arriving; later steps
                         also those received and the step's partial out and lse, 4*Q (merged
                         into the running ones in place, no temporaries of out's size)
The ring on the fused kernel (a plain causal mask; measured exactly, per ring rank: its
later steps take all query rows x half the keys, or half the rows x all keys):
    ring backward        the largest later step at the kernel's return: dout, dq's fp32
                         accumulator, the received keys and values and those arriving (all
                         steps but the last), the fp32 dk, dv accumulators in flight and
                         arriving, 4*4K, and the kernel's shares in q's dtype for its rows and
                         keys (the kernel's own scratch is no tensor on CPU)
    ring forward         the largest later step at its merge: the running fp32 out beyond
                         the kept one, the received keys and values and those arriving, the
                         step's partial out (q's dtype; and its fp32 copy under autocast) and
                         lse for its rows, and the merge's four lse-sized temporaries

Communication per iteration, bytes this rank sends per (group, kind), comm.py's conventions
(the group is the mesh dim: sp, cp, tp, dp_sp, pp): Ulysses
`ulysses_bytes_per_layer` over the ring rank's S/C positions per layer and micro-batch
forward, again backward, and again for layers full recomputation reruns; the ring
`ring_bytes_per_layer` (kind "ring": k, v forward, (C-1)*2*b*(S/C)*(kv/sp)*d*e; backward
the same again plus the fp32 gradient accumulators, C*2*b*(S/C)*(kv/sp)*d*4) per layer and
micro-batch, its forward again for layers full recomputation reruns and, the core being
the ring, under selective recomputation for every layer; tensor parallel: the sublayer
outputs all-reduced (e bytes) or under Megatron-SP reduce-scattered with the fp32 normed
inputs all-gathered (`megatron_sp_bytes_per_layer`), backward the same kinds swapped
(input gradients fp32), recomputation repeating the forward ones but the group's last MLP
output (the checkpoint stops at fc2's input; with a tiled MLP it reruns whole, while each
chunk's own recompute stops at fc2's input), a tiled MLP under Megatron-SP gathering its
input again; the embedding's and the vocab-parallel loss's collectives; ZeRO over N =
dp*cp*sp (tests/parallel/test_zero.py): stage 0 all-reduce of P, stage 1 reduce-scatter and
all-gather of N padded pieces, stage 2 m reduce-scatters and one all-gather, stage 3 m
reduce-scatters and m (root + 2 x blocks) all-gathers (under pp one each); pipeline:
activations forward and gradients backward per micro-batch and local stage, the tied
embedding's gradient between the first and last stage; a few fp64 scalars (token count,
loss, grad norm).

Not modelled: forward-time peaks outside recomputation (the explicit `math`
attention backend's S*S temporaries: ~7% above the plan); backend scratch inside
collectives and kernels; packed documents' effect on the keys a block attends (the plan
assumes one document).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from megaulysses.config import Config, pipeline_layout
from megaulysses.parallel.dims import CP, DP_SP, PP, SP, TP, ParallelDims
from megaulysses.parallel.ring import ring_bytes_per_layer
from megaulysses.parallel.ulysses import ulysses_bytes_per_layer

MIB = 2 ** 20
F32 = 4
BUCKET_BYTES = 25 * 2 ** 20  # comm.GradReducer's default bucket
CPU_BLOCK_MAX_SEQ = 1024  # model.attention.cpu_attention's limit for the block kernel
BLOCK_ROWS = 64  # attention.block_causal.block_causal_attention's query block
CE_BUDGET = {"cpu": 2 ** 23, "cuda": 2 ** 28}  # ops.cross_entropy._rows_per_chunk: logit elements
BATCH_BYTES_PER_TOKEN = 3 * 8 + 4  # tokens, labels, positions (int64), loss mask (fp32)
DOCUMENT_ID_BYTES = 4  # the batch's documents: int32 ids of the whole sample, every rank
LAYOUT_GRID_MAX = 4096  # sparse layouts of more blocks: a bound instead of the grid

# parallel/tensor.py's plan: these weights are split by rows (dim 0; their biases too),
# those by columns (dim 1; their biases stay whole); everything else is replicated.
_COLWISE = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc1.", "mlp.gate.", "head.output.",
            "embed.word.")
_ROWWISE = ("attn.out.", "mlp.fc2.")


@dataclass
class MemoryPlan:
    """Bytes one rank of pipeline stage `pp_rank` holds (rank 0 of its dp x cp x sp
    group)."""

    pp_rank: int
    zero_stage: int  # in effect (0 when dp x cp x sp is one rank)
    layers: int  # transformer layers on this rank
    micro_batches: int  # per step
    in_flight: int  # micro-batches (model chunks) whose activations are held at once
    tokens: int  # T: tokens of a micro-batch on this rank
    param_bytes: int  # parameters and buffers held at the peak moment
    grad_bytes: int  # gradients held at the peak moment
    optimizer_bytes: int  # AdamW's states
    activation_bytes_per_layer: int  # what one layer keeps for one micro-batch
    activation_bytes: int  # kept for backward at the peak moment, all micro-batches
    transient_bytes: int  # at the peak: recomputed activations, temporaries, buckets,
    # the step's batches, the pipeline's receive buffers
    peak_bytes: int  # the sum of the five above at the largest moment
    peak_moment: str
    moments: dict = field(default_factory=dict)  # every moment considered -> its bytes
    layer_terms: dict = field(default_factory=dict)  # what a layer keeps, by term (full
    # recomputation: what it holds while recomputed)
    comm_bytes: dict = field(default_factory=dict)  # collective kind -> bytes/iteration
    comm_by_group: dict = field(default_factory=dict)  # (mesh dim, kind) -> bytes/iteration
    attention: str = ""  # the attention core the plan assumes, in words
    recomputed_layers: int = 0  # layers whose forward runs again per micro-batch (full)


def plan_memory(cfg: Config, dims: ParallelDims, pp_rank: int = 0,
                device_type: Optional[str] = None, cp_rank: int = 0) -> MemoryPlan:
    """The plan of pipeline rank `pp_rank` (`cfg` validated, `cfg.model.vocab_size` set
    from the tokenizer). `device_type`: where the run would be (None: cuda if available,
    else cpu, as the trainer picks); it decides the attention kernel and the loss's
    chunks. `cp_rank`: the ring rank (the zigzag gives the ranks different keys per ring
    step: under the causal mask alone the last one fewer, rank 0, the default, the most;
    with a window another rank may hold more)."""
    if cfg.model.vocab_size <= 0:
        raise ValueError("plan_memory needs cfg.model.vocab_size (from the tokenizer)")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    rank = _RankLayout.of(cfg, dims, pp_rank)
    s = _shape(cfg, dims, device_type, cp_rank)
    states = _States(_stage_params(cfg, dims, rank), rank.zero_stage, _zero_ranks(dims),
                     dims.pp > 1, s, cfg)
    acts = _Activations(s, cfg, rank)
    moments = _moments(states, acts, rank, _held_outside_model(s, rank, dims.pp))
    name = max(moments, key=lambda k: sum(moments[k].values()))
    peak = moments[name]
    by_group = comm_bytes(cfg, dims, s, states, acts, rank)
    return MemoryPlan(
        pp_rank=pp_rank, zero_stage=rank.zero_stage, layers=rank.layers,
        micro_batches=rank.m, in_flight=rank.in_flight, tokens=s.T,
        param_bytes=peak["params"], grad_bytes=peak["grads"],
        optimizer_bytes=peak["optimizer"], activation_bytes_per_layer=acts.per_layer,
        activation_bytes=peak["activations"], transient_bytes=peak["transient"],
        peak_bytes=sum(peak.values()), peak_moment=name, attention=_describe(s),
        moments={k: sum(v.values()) for k, v in moments.items()}, layer_terms=acts.terms,
        comm_bytes=bytes_by_kind(by_group), comm_by_group=by_group,
        recomputed_layers=acts.rerun[0])


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
        m = t.global_batch_size // (t.micro_batch_size * dims.dp)
        schedule = par.pipeline_schedule if dims.pp > 1 else None
        return cls(ids=ids, stage_layers=tuple(len(layout[i]) for i in ids), first=0 in ids,
                   last=len(layout) - 1 in ids, m=m,
                   in_flight=_in_flight(schedule, dims.pp, pp_rank, m, len(ids)),
                   zero_stage=par.zero_stage if _zero_ranks(dims) > 1 else 0)


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
    # zero-bubble: a chunk's activations live until its weight-gradient pass, one chunk
    # more than 1F1B holds (measured)
    return min((chunks - 1) * per_round + (pp - 1 - rank) + 2, m * chunks)


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
    tp: int
    sp: int
    cp: int  # C: ring ranks
    mega_sp: bool
    swiglu: bool
    rope: bool
    layernorm: bool
    hidden_dropout: bool
    kernel: str  # block | masked | ring | sdpa | fused | sdpa-math | math
    ce_rows: int  # rows of a cross-entropy chunk
    block: int = 64  # masked / ring: the kernel's block of query (and key) positions
    keys: int = 0  # masked / ring: the most keys one query block attends in one call
    # (the ring: at its first step, the rank's own keys)
    keys_later: int = 0  # the ring's later steps: the most keys of another rank's
    keys_arriving: int = 0  # ... at a later step while the next step's keys arrive
    documents: bool = False  # the batch carries packed documents' ids
    fused: bool = False  # ring: every step on the fused kernel (plain causal mask)
    cp_rank: int = 0  # the ring rank planned

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
    mega_sp = cfg.parallel.sequence_parallel and tp > 1
    T = t.micro_batch_size * m.seq_length // (sp * cp)
    kernel = _kernel(cfg, dims, device_type)
    fused = kernel == "ring" and _fused(cfg, device_type)
    blocks = (_blocks(m, cp, cp_rank) if kernel in ("masked", "ring") and not fused
              else (64, 0, 0, 0))
    hkv = m.num_kv_heads // tp
    V = m.padded_vocab_size // tp
    return _Shape(b=t.micro_batch_size, S=m.seq_length, T=T, Tr=T // tp if mega_sp else T,
                  h=m.hidden_size, d=m.head_dim, hq=m.num_attention_heads // tp, hkv=hkv,
                  kv=max(hkv, sp) if sp > 1 and hkv % sp else hkv, f=m.ffn_size // tp, V=V,
                  e=2 if t.bf16 or t.fp16 else F32, tp=tp, sp=sp, cp=cp, mega_sp=mega_sp,
                  swiglu=m.swiglu, rope=m.position_embedding_type == "rope",
                  layernorm=m.normalization == "LayerNorm", hidden_dropout=m.hidden_dropout > 0,
                  kernel=kernel, block=blocks[0], keys=blocks[1], keys_later=blocks[2],
                  keys_arriving=blocks[3],
                  documents=cfg.data.reset_attention_mask, fused=fused, cp_rank=cp_rank,
                  ce_rows=max(1, min(T, CE_BUDGET.get(device_type, CE_BUDGET["cuda"]) // V)))


def _describe(s: _Shape) -> str:
    """The attention core of the plan, in words (for the table)."""
    names = {"block": "CPU query-block kernel (causal, keeps probabilities)",
             "masked": "block kernel", "ring": f"ring over cp {s.cp}, block kernel",
             "sdpa": "SDPA / flash (keeps the logsumexp)",
             "fused": "block backend, plain causal: fused kernel (keeps the logsumexp)",
             "sdpa-math": "SDPA math path (dropout)", "math": "math (explicit scores)"}
    words = names[s.kernel]
    if s.fused:
        return f"ring over cp {s.cp}, fused kernel (with lse, one call a step)"
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
    """The attention core `select_backend`, `cpu_attention` and the ring run."""
    m, half = cfg.model, cfg.train.bf16 or cfg.train.fp16
    if dims.cp > 1:
        return "ring"  # parallel/ring.py, whatever the backend (and inside Ulysses)
    if m.attention_backend == "math":
        return "math"
    if m.attention_backend == "block" and _fused(cfg, device_type):
        return "fused"  # the block backend's fused kernel: q, k, v, out, lse, as SDPA
    if m.attention_backend == "block" or (device_type == "cpu" and _masked(cfg)
                                          and m.attention_backend == "auto"):
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


def _ring_keys(S: int, cp: int, rank: int, block: int, window: Optional[int]) -> list[int]:
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
    return keys


def _layout_blocks_attended(layout, n: int) -> int:
    """The most layout blocks one query block attends (over n blocks): from the layout's
    grid, or beyond LAYOUT_GRID_MAX blocks its rule's bound."""
    if n <= LAYOUT_GRID_MAX:
        return int(layout.blocks(n).sum(dim=1).max())
    if layout.kind == "bigbird":
        return min(n, layout.local + layout.global_ + layout.random)
    return min(n, layout.local + layout.global_ * (n // layout.local))


# -- parameters and model states ---------------------------------------------------------------

_PARAMS_CACHE: dict = {}  # (model config, layout, stages) -> [(name, shape)]; the
# planner's grid search plans many grids of one model (a meta GPT takes ~50 ms to build)


def _stage_params(cfg: Config, dims: ParallelDims, rank: _RankLayout) -> list[tuple]:
    """(name, tensor-parallel local shape) of every parameter this pipeline rank holds:
    the GPT built on the meta device and cut to the rank's stages as parallelize does."""
    layout = pipeline_layout(cfg.model.num_layers, cfg.parallel) if dims.pp > 1 else None
    key = (repr(cfg.model), repr(layout), rank.ids)
    if key not in _PARAMS_CACHE:
        from megaulysses.model.gpt import GPT
        from megaulysses.parallel.pipeline import keep_stages
        with torch.device("meta"):
            model = GPT(cfg.model)
        if layout is not None:
            keep_stages(model, layout, list(rank.ids))
        if len(_PARAMS_CACHE) >= 256:
            _PARAMS_CACHE.clear()
        _PARAMS_CACHE[key] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return [(n, _tp_local(n, shape, dims.tp)) for n, shape in _PARAMS_CACHE[key]]


def _tp_local(name: str, shape: tuple, tp: int) -> tuple:
    if tp > 1 and any(k in name for k in _COLWISE):
        return (shape[0] // tp,) + shape[1:]
    if tp > 1 and any(k in name for k in _ROWWISE) and name.endswith("weight"):
        return (shape[0], shape[1] // tp)
    return shape


@dataclass(frozen=True)
class _Sizes:
    """fp32 bytes of some parameters: whole (tp shards), one rank's ZeRO piece (padded to
    ceil(rows/N) rows, as FSDP stores and collectives move it), rank 0's actual rows."""

    whole: int
    piece: int
    rows: int

    @classmethod
    def of(cls, shapes: list, n: int) -> "_Sizes":
        chunk = lambda sh: -(-sh[0] // n)  # noqa: E731
        return cls(whole=F32 * sum(math.prod(sh) for sh in shapes),
                   piece=F32 * sum(chunk(sh) * math.prod(sh[1:]) for sh in shapes),
                   rows=F32 * sum(min(chunk(sh), sh[0]) * math.prod(sh[1:]) for sh in shapes))


class _States:
    """Parameters, gradients and optimizer states of this rank (rank 0 of dp x cp x sp), and
    the ZeRO working sets, in bytes (the module doc's "Model states")."""

    def __init__(self, params: list, stage: int, n: int, pipeline: bool, s: _Shape,
                 cfg: Config):
        self.stage, self.n, self.pipeline = stage, n, pipeline
        half = cfg.train.bf16 or cfg.train.fp16
        first_block = next((_block(name) for name, _ in params if _block(name)), None)
        block = [(name, sh) for name, sh in params if _block(name) == first_block]
        everything = _Sizes.of([sh for _, sh in params], n)
        self.local, self.piece = everything.whole, everything.piece
        self.block = _Sizes.of([sh for _, sh in block], n).whole
        self.block_mlp = _Sizes.of([sh for name, sh in block if ".mlp." in name], n).whole
        self.block_padded = n * _Sizes.of([sh for _, sh in block], n).piece
        root = _Sizes.of([sh for name, sh in params if not _block(name)], n)
        tied = not cfg.model.untie_embeddings_and_output_weights
        self.head_grads = _Sizes.of([sh for name, sh in params if name.startswith("head.")
                                     or (tied and name.startswith("embed.word"))], n).whole
        self.root, self.root_piece = root.whole, root.piece
        self.buckets = _buckets([(F32 * math.prod(sh), n * _Sizes.of([sh], n).piece)
                                 for _, sh in params])
        self.optimizer = 2 * (self.local if stage == 0 else everything.rows) + F32 * len(params)
        self.held_params = self.piece if stage >= 2 else self.local
        # autocast caches e-byte copies of the blocks' linear weights, saved for backward
        self.cast_copies = (2 * sum(math.prod(sh) for name, sh in params
                                    if _block(name) and len(sh) == 2)
                            if half and stage < 2 else 0)
        self.reduce_e = 2 if cfg.parallel.grad_reduce_dtype == "bf16" else F32
        self.gather_e = 2 if half else F32  # FSDP gathers in the compute dtype

    @property
    def fsdp_per_block(self) -> bool:
        """Stages 2/3 without pp: FSDP gathers and reduce-scatters block by block, every
        micro-batch; under pp it does so once a step, like stage 0 in between."""
        return self.stage >= 2 and not self.pipeline

    def grads_accumulated(self) -> int:
        """Gradients held after a micro-batch's backward, before the step's last one."""
        return self.piece if self.fsdp_per_block else self.local

    def gathered(self, blocks: int) -> int:
        """Parameters FSDP holds unsharded (compute dtype): everything (stage 2, and 2/3
        under pp), or (stage 3) the root unit and `blocks` blocks."""
        if self.stage < 2:
            return 0
        if self.pipeline or self.stage == 2:
            return self.local * self.gather_e // F32
        return (self.root + blocks * self.block_padded) * self.gather_e // F32

    def new_grads(self, done: int, later: bool) -> int:
        """Gradients the last layer's backward has made so far (`done` bytes of its
        parameters) beyond what is held: fresh in a step's first backward, accumulated in
        place later; FSDP makes them unsharded in the compute dtype in every backward."""
        if self.fsdp_per_block:
            return done * self.gather_e // F32
        return 0 if later else done

    def block_reduce_scatter(self) -> int:
        """FSDP reduce-scattering a block's gradients: the flat input (padded, reduce
        dtype) beside the unsharded gradients, then beside the output."""
        if self.stage < 2:
            return 0
        rs_in = self.block_padded * self.reduce_e // F32
        return rs_in + max(self.block * self.gather_e // F32, rs_in // self.n)

    def reduction(self) -> dict:
        """{moment: (gradients, working set)} of the dp x cp x sp reduction and the step."""
        if self.n == 1 or self.stage >= 2:
            return {"step": (self.grads_accumulated(), 0)}
        last_local, last_padded = self.buckets[-1]
        if self.stage == 0:  # each bucket's flat copy, cast from an fp32 concatenation
            flats = sum(b for b, _ in self.buckets) * self.reduce_e // F32
            return {"reduction": (self.local, flats + (last_local if self.reduce_e != F32
                                                       else 0))}
        earlier = (sum(b for _, b in self.buckets) - last_padded) * self.reduce_e // F32
        return {"reduction": (last_local, earlier + 2 * last_padded),
                "step": (self.piece, (1 + self.n) * self.piece)}


def _block(name: str) -> Optional[str]:
    """The layer index of a block's parameter, None for the root unit's."""
    return name.split(".")[1] if name.startswith("layers.") else None


def _buckets(sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """comm._make_buckets over (bytes, padded bytes) per parameter: in reverse order, a
    bucket closed once it reaches BUCKET_BYTES; both sums per bucket."""
    buckets, local, padded = [], 0, 0
    for n, n_padded in reversed(sizes):
        local, padded = local + n, padded + n_padded
        if local >= BUCKET_BYTES:
            buckets.append((local, padded))
            local, padded = 0, 0
    if local:
        buckets.append((local, padded))
    return buckets or [(0, 0)]


# -- activations -----------------------------------------------------------------------------

class _Activations:
    """What a micro-batch keeps for backward on this rank, and what its backward adds."""

    def __init__(self, s: _Shape, cfg: Config, rank: _RankLayout):
        mem = cfg.memory
        self.s, self.rank = s, rank
        self.chunks, self.recompute = mem.tiled_mlp_chunks, mem.recompute_granularity
        self.terms = _layer_terms(s, self.recompute == "selective", self.chunks)
        self.layers = rank.layers
        self.recomputed = 0  # full: the most a group's recomputation adds to what is kept
        self.rerun = (0, 0)  # full: (layers, groups) whose forward runs again
        self.layers_kept = sum(self.terms.values()) * self.layers
        if self.recompute == "full":
            self._full_recompute(mem)
        self.per_layer = self.layers_kept // max(1, self.layers)
        self.head = _head_kept(s) if rank.last else 0
        self.rotary = 2 * F32 * s.T * s.d // 2 if s.rope and self.layers else 0
        self.output = 0 if rank.last else F32 * s.Tr * s.h  # the pipeline keeps it
        self.embedding = 9 * s.T if rank.first and s.tp > 1 else 0  # vocab-parallel ids
        if rank.first and s.hidden_dropout:
            self.embedding += F32 * s.Tr * s.h
        self.tied = (not cfg.model.untie_embeddings_and_output_weights and rank.first
                     and rank.last)

    def _full_recompute(self, mem):
        """Full recomputation, per stage: a checkpointed group keeps its input, the others
        everything; the worst group's backward adds its layers back in full; which layers
        (and groups) run forward again."""
        from megaulysses.parallel.recompute import layer_groups
        layer = sum(self.terms.values())  # what a layer holds while recomputed
        self.layers_kept, layers, groups = 0, 0, 0
        for n in (n for n in self.rank.stage_layers if n):
            cut = layer_groups(n, mem.recompute_method, mem.recompute_num_layers)
            kept = [F32 * self.s.Tr * self.s.h if again else (end - a) * layer
                    for a, end, again in cut]
            # A group's backward: the groups before it keep theirs, it holds all again.
            worst = max(sum(kept[:i]) + (end - a) * layer for i, (a, end, _) in enumerate(cut))
            self.recomputed = max(self.recomputed, worst - sum(kept))
            self.layers_kept += sum(kept)
            layers += sum(end - a for a, end, again in cut if again)
            groups += sum(1 for *_, again in cut if again)
        self.rerun = (layers, groups)

    def per_micro_batch(self) -> int:
        return self.layers_kept + self.head + self.output + self.embedding + self.rotary

    def last_layer_kept(self) -> int:
        """What the last layer's backward frees (full: a recomputed group frees what it
        brought back, counted as transient)."""
        return 0 if self.recompute == "full" else self.per_layer

    def backward_moments(self) -> dict:
        """{moment: this micro-batch's activations + its backward's temporaries} at the
        moments of its backward where the peak can be (the module doc's list)."""
        s, kept = self.s, self.per_micro_batch()
        out = {"head backward": kept + self._head_backward()} if self.rank.last else {}
        live = kept - self.head + self.recomputed  # the head's tensors are freed by now
        if self.tied:  # the loss's gradient of the tied embedding waits for the lookup's
            live += F32 * s.V * s.h
        stream = F32 * s.Tr * s.h  # the residual stream's gradient
        if self.rank.last:  # and the loss's input gradient, still referenced (measured)
            stream += F32 * s.Tr * s.h
        # Megatron-SP: fc2's reduce-scatter's backward all-gathers that gradient (per chunk
        # when tiled); it lives through fc2's backward, and recomputation runs meanwhile.
        gathered = F32 * s.T * s.h // self.chunks if s.mega_sp else 0
        mlp = 2 * s.e * s.T * s.f // self.chunks + stream + gathered
        if self.chunks > 1:  # one chunk of the MLP recomputed; the chunks' input gradients
            mlp += sum(_mlp_terms(s).values()) // self.chunks + F32 * s.Tr * s.h
        out["mlp backward"] = live + mlp
        freed = sum(v for k, v in self.terms.items() if k.startswith("mlp") or k == "out input")
        core = _core_backward(s)
        if self.recompute == "selective":  # the core's internals again (the ring's and the
            # masked kernel's inputs are the checkpoint's, already kept)
            core += sum(_core_terms(s).values()) - (
                s.e * (s.Q + 2 * s.K) if s.kernel in ("ring", "masked") else 0)
        out["core backward"] = live - freed + stream + core
        # q, k and v's input gradients summed: two partial sums and the total at once (under
        # tensor parallelism DTensor's accumulation is out of place; else in place, two).
        core_in = sum(v for k, v in self.terms.items() if k.startswith("core"))
        qkv = s.e * s.T * (s.hq + 2 * s.kv) * s.d + (3 if s.tp > 1 else 2) * F32 * s.T * s.h
        out["qkv backward"] = live - freed - core_in + stream + qkv
        if self.recompute == "full" and (s.sp > 1 or _core_forward(s)):
            # the caller's q, k, v before the all-to-all, beside the core's forward working
            # set, then the output all-to-all's packing
            ulysses = s.e * s.T * (s.hq + 2 * s.kv) * s.d if s.sp > 1 else 0
            packing = s.e * s.T * s.hq * s.d if s.sp > 1 else 0
            out["attention recomputed"] = live - self._mlp_of_layer() + stream + ulysses + max(
                packing, _core_forward(s))
        return out

    def _mlp_of_layer(self) -> int:
        return sum(v for k, v in self.terms.items() if k.startswith("mlp"))

    def _head_backward(self) -> int:
        """The loss's backward on top of everything kept (see the module doc)."""
        s = self.s
        rows = min(s.T, s.ce_rows)
        chunk = 0 if s.ce_kept else F32 * rows * s.V  # recomputed (else counted as kept)
        prev = F32 * min(rows, s.T - rows) * s.V if s.T > rows else 0
        both = (F32 + s.e) / F32 if s.e != F32 else 1  # a chunk in two dtypes at once
        cast = s.e * rows * s.V if s.e != F32 else 0  # dlogits in the matmul dtype
        largest = max(F32 * s.h * s.V + s.e * s.h * rows + chunk + cast,  # a dW product
                      int((prev + chunk) * both),  # the next chunk's exps
                      s.e * s.V * s.h + chunk + cast)  # the final dW
        return F32 * s.h * s.V + s.e * s.T * s.h + 3 * F32 * s.T + largest


def _layer_terms(s: _Shape, selective: bool, chunks: int) -> dict:
    """What one layer keeps for backward, by term (a recomputed layer: while it is)."""
    t = {"attn norm": _norm(s), "attn input": _linear_input(s, 3)}
    if selective:
        t["core inputs"] = s.e * s.T * (s.hq + 2 * s.kv) * s.d
    else:
        t.update(_core_terms(s))
    if not _core_out_is_saved(s, selective):
        t["out input"] = s.e * s.T * s.hq * s.d
    if chunks > 1:
        t["mlp (tiled) input"] = F32 * s.Tr * s.h
    else:
        t.update(_mlp_terms(s))
    if s.hidden_dropout:
        t["dropout masks"] = 2 * F32 * s.Tr * s.h
    return t


def _core_out_is_saved(s: _Shape, selective: bool) -> bool:
    """The out-projection's input is the very tensor the core saves (no Ulysses between
    them, no recomputation): SDPA's output; the masked kernel's and the ring's, both saved
    in q's dtype and laid out [b, s, h, d], contiguous, so that the projection's reshape is
    a view."""
    if selective or s.sp > 1:
        return False
    return s.kernel in ("sdpa", "fused", "masked", "ring")


def _norm(s: _Shape) -> int:
    return F32 * s.Tr * (s.h + (2 if s.layernorm else 1))


def _linear_input(s: _Shape, linears: int) -> int:
    """The normed input saved by the linears reading it: one fp32 tensor, or under
    autocast each linear's own e-byte copy."""
    return (linears * s.e if s.e != F32 else F32) * s.T * s.h


def _core_terms(s: _Shape) -> dict:
    qkv_out = s.T * (2 * s.hq + 2 * s.kv) * s.d
    square = F32 * s.b * s.core_heads * s.S * s.S
    if s.kernel == "block":
        return {"core q,k,v,out": F32 * qkv_out, "core probabilities": F32 * _probs(s)}
    if s.kernel == "math":
        return {"core q,k,v,out": F32 * qkv_out, "core probabilities": square}
    if s.kernel == "sdpa-math":
        return {"core q,k,v": s.e * s.T * (s.hq + 2 * s.kv) * s.d,
                "core probabilities": 3 * square}
    return {"core q,k,v,out": s.e * qkv_out, "core logsumexp": s.lse}  # sdpa, masked, ring


def _probs(s: _Shape) -> int:
    """Elements of the block kernel's causal probabilities: per (sample, head) each query
    block's rows times the keys up to its end."""
    blocks = ((i, min(i + BLOCK_ROWS, s.S)) for i in range(0, s.S, BLOCK_ROWS))
    return s.b * s.core_heads * sum((end - i) * end for i, end in blocks)


def _core_backward(s: _Shape) -> int:
    """The core's backward working set beyond what it keeps: dq, dk, dv, dout (and the
    block kernel's two gradient blocks of 64 query rows; the masked kernel's and the ring's
    below)."""
    qkv = s.T * (2 * s.hq + 2 * s.kv) * s.d
    if s.kernel == "block":
        return F32 * (qkv + 2 * s.b * s.core_heads * BLOCK_ROWS * s.S)
    if s.kernel == "masked":
        return _masked_backward(s)
    if s.kernel == "ring":
        return _ring_fused_backward(s) if s.fused else _ring_backward(s)
    return s.e * qkv


def _masked_backward(s: _Shape) -> int:
    """model/attention/block.py's partial_backward over the whole sequence (measured): dout;
    q grouped and scaled, k, v grouped (copies); dout grouped (a copy with GQA); fp32 dq,
    dk, dv; one query block's P and dS (`_Shape.scores`); row statistics and masks."""
    e = s.e
    grouped = e * s.Q + 2 * e * s.K + (e * s.Q if s.rep > 1 else 0)  # q, k, v, dout
    grads = F32 * (s.Q + 2 * s.K)
    return e * s.Q + grouped + grads + _block_set(s, s.keys)


def _block_set(s: _Shape, keys: int, backward: bool = True) -> int:
    """One query block of `keys` keys (`_Shape.scores`) and the kernels' small change
    (measured): backward delta and the lse made +inf where it is -inf (with GQA also
    delta's grouped copy), the block's element mask, a byte per score of its block * rep
    rows by its keys, and a block's rows of a gradient, fp32; forward the larger of the
    mask and its negation (autocast: the mask) and a block's output."""
    out_rows = F32 * (1 if s.documents else s.b) * s.core_heads * s.block * s.d
    if not backward:  # at the scores' masking (fp32) or cast (autocast), or at the output
        return s.scores(keys, False) + max(
            (2 if s.e == F32 else 1) * s.block * s.rep * keys, out_rows)
    return (s.scores(keys) + (2 + (1 if s.rep > 1 else 0)) * s.lse
            + s.block * s.rep * keys + out_rows)


def _ring_backward(s: _Shape) -> int:
    """parallel/ring.py's backward (measured), the largest of its first step and its later
    ones (with and without keys arriving): dout (and its fp32 copy under autocast); the
    step's partial_backward: q scaled, k, v grouped, dout grouped (fp32, with GQA), its
    fp32 dq, dk, dv shares, one query block's P and dS; the keys and values arriving for
    the next step (all steps but the last). Later steps also: dq's accumulator, the step's
    received keys and values, the last step's dk, dv in flight (sent as they are, held
    until the next step's wait) and the accumulators arriving, 4*4K."""
    e, kv = s.e, 2 * s.e * s.K
    common = (e * s.Q + (F32 * s.Q if e != F32 else 0)  # dout, fp32
              + e * s.Q + kv + (F32 * s.Q if s.rep > 1 else 0)  # grouped
              + F32 * (s.Q + 2 * s.K))  # the step's shares
    later = common + F32 * s.Q + kv + 4 * F32 * s.K  # dq's sum, received, in flight
    return max(common + kv + _block_set(s, s.keys),
               later + _block_set(s, s.keys_later),
               later + kv + _block_set(s, s.keys_arriving) if s.keys_arriving else 0)


def _core_forward(s: _Shape) -> int:
    """The core's forward working set beyond what it keeps (0 where small): the masked
    kernel's q scaled, k, v grouped, one query block's scores (`_Shape.scores`), its output
    written in place into the kept one; the ring at a step's scores: partial_forward's
    grouped copies, the running fp32 out beyond the kept one (autocast: cast at the end),
    the keys and values arriving (all steps but the last) and, later steps, those received
    and the step's partial out and lse (merged into the running ones in place)."""
    e, kv = s.e, 2 * s.e * s.K
    grouped = e * s.Q + kv  # q scaled, k, v
    if s.kernel == "masked":
        return grouped + _block_set(s, s.keys, backward=False)
    if s.kernel != "ring":
        return 0
    if s.fused:
        return _ring_fused_forward(s)
    common = grouped + (F32 - e) * s.Q
    later = common + kv + F32 * s.Q + s.lse  # received, the step's partial
    return max(common + kv + _block_set(s, s.keys, False),
               later + _block_set(s, s.keys_later, False),
               later + kv + _block_set(s, s.keys_arriving, False) if s.keys_arriving else 0)


def _fused_ring_steps(s: _Shape) -> list[tuple[float, float, bool]]:
    """The fused ring's later steps t = 1..C-1 on ring rank s.cp_rank (parallel/ring.py's
    `fused_step`): (share of the query rows, share of the keys, the next keys arriving):
    an earlier rank's keys: all rows x its early chunk; a later rank's: the late chunk x
    all its keys."""
    c, C = s.cp_rank, s.cp
    return [((1.0, 0.5) if (c - t) % C < c else (0.5, 1.0)) + (t < C - 1,)
            for t in range(1, C)]


def _ring_fused_backward(s: _Shape) -> int:
    """parallel/ring.py's backward on the fused kernel (measured), the largest of its later
    steps at the kernel's return (step 0 holds less): dout; dq's fp32 accumulator; the
    step's received keys and values and those arriving for the next step (all but the
    last); the last step's fp32 dk, dv accumulators in flight and those arriving, 4*4K;
    the kernel's dq, dk, dv shares in q's dtype, for its rows and keys only. (A kernel's own
    scratch is not counted: on CPU it is no tensor.)"""
    e, kv = s.e, 2 * s.e * s.K
    held = e * s.Q + F32 * s.Q + kv + 4 * F32 * s.K
    return max(held + (kv if arriving else 0) + int(e * (rows * s.Q + 2 * keys * s.K))
               for rows, keys, arriving in _fused_ring_steps(s))


def _ring_fused_forward(s: _Shape) -> int:
    """parallel/ring.py's forward on the fused kernel, the largest of its later steps at
    the merge: the running fp32 out beyond the kept one, the step's received keys and
    values and those arriving (all but the last); the kernel's partial out (q's dtype) and
    lse for its rows, the out's fp32 copy (16-bit) and the merge's four lse-sized
    temporaries."""
    e, kv = s.e, 2 * s.e * s.K
    held = (F32 - e) * s.Q + kv

    def partial(rows: float) -> int:
        return int(rows * ((e + (F32 if e != F32 else 0)) * s.Q + 5 * s.lse))

    return max(held + (kv if arriving else 0) + partial(rows)
               for rows, _, arriving in _fused_ring_steps(s))


def _mlp_terms(s: _Shape) -> dict:
    return {"mlp norm": _norm(s), "mlp input": _linear_input(s, 2 if s.swiglu else 1),
            "mlp hidden": (4 if s.swiglu else 2) * s.e * s.T * s.f}


def _head_kept(s: _Shape) -> int:
    """Final norm, the loss's input (and its e-byte weight copy), its per-token
    statistics, and the one chunk of exps it keeps when everything fits in one."""
    out = _norm(s) + s.e * s.T * s.h + 25 * s.T
    if s.e != F32:
        out += s.e * s.V * s.h
    if s.ce_kept:
        out += F32 * s.T * s.V
    return out


def _held_outside_model(s: _Shape, rank: _RankLayout, pp: int) -> int:
    """The step's micro-batches (concatenated once more under pp) and the pipeline's
    receive buffers: activations into every stage but the first, gradients into every
    stage but the last, one per micro-batch each."""
    per_micro = s.T * BATCH_BYTES_PER_TOKEN + (
        DOCUMENT_ID_BYTES * s.b * s.S if s.documents else 0)  # the whole samples' ids
    batches = rank.m * per_micro * (2 if pp > 1 else 1)
    if pp == 1:
        return batches
    receives = 2 * rank.chunks - rank.first - rank.last
    return batches + receives * rank.m * F32 * s.Tr * s.h


# -- the moments -------------------------------------------------------------------------------

def _moments(st: _States, acts: _Activations, rank: _RankLayout, other: int) -> dict:
    """{moment: {params, grads, optimizer, activations, transient}} where the peak can be.

    In flight are `rank.in_flight` model chunks (micro-batches without virtual stages),
    each keeping 1/chunks of what a micro-batch keeps on this rank; the one whose
    backward runs frees some of its own and adds temporaries (transient)."""
    unit, kept = acts.per_micro_batch() // rank.chunks, acts.per_micro_batch()
    flight, total = rank.in_flight, rank.m * rank.chunks
    later = flight if total > flight else flight - 1  # while forwards remain
    moments = {}

    def add(name, grads, act, transient, params):
        moments[name] = {"params": params, "grads": grads, "optimizer": st.optimizer,
                         "activations": act, "transient": transient + other}

    def both(name, act, transient, params, new_grads=(0, 0)):
        add(f"{name}, first", new_grads[0], (flight - 1) * unit + act, transient, params)
        if total > 1:
            add(f"{name}, later", st.grads_accumulated() + new_grads[1],
                (later - 1) * unit + act, transient, params)

    done = {"head backward": 0, "mlp backward": st.block_mlp, "core backward": st.block,
            "qkv backward": st.block, "attention recomputed": 0}
    # FSDP: the head's unsharded gradients wait for the root unit's reduce-scatter, at the
    # end of the micro-batch's backward
    head = st.head_grads if rank.last and st.fsdp_per_block else 0
    for name, live in acts.backward_moments().items():
        blocks = 1 if name in ("head backward", "attention recomputed") else min(2, acts.layers)
        part = (done[name] if acts.layers else 0) + (head if name != "head backward" else 0)
        both(name, unit + min(0, live - kept), max(0, live - kept),
             st.held_params + st.gathered(blocks) + st.cast_copies,
             (st.new_grads(part, False), st.new_grads(part, True)))
    if st.block_reduce_scatter():  # the block itself is resharded before it
        both("block reduce-scatter", unit - acts.head - acts.last_layer_kept(),
             st.block_reduce_scatter(), st.held_params + st.gathered(1))
    for name, (grads, transient) in st.reduction().items():
        add(name, grads, 0, transient, st.held_params)
    return moments


# -- communication ---------------------------------------------------------------------------

def comm_bytes(cfg: Config, dims: ParallelDims, s: _Shape, st: _States, acts: _Activations,
               rank: _RankLayout) -> dict:
    """Bytes this rank sends per iteration, {(group, kind): bytes} (the module doc's list;
    the group is the mesh dim the collective runs over, as comm.CommStats counts it)."""
    out = defaultdict(float)
    m, layers = rank.m, rank.layers
    forwards = m * (layers + acts.rerun[0])  # layer forwards per iteration
    if s.sp > 1:  # over the ring rank's S/C positions
        a2a = ulysses_bytes_per_layer(s.b, s.Sc, s.hq, s.hkv, s.d, s.sp, s.e)
        out[(SP, "all_to_all")] += a2a * (forwards + m * layers)
    if s.cp > 1:  # the ring: keys and values forward, again with their gradients backward;
        # its forward reruns with the layer (full) or the core (selective) recomputed
        fwd, bwd = ring_bytes_per_layer(s.b, s.S, s.kv // s.sp, s.d, s.cp, s.e)
        rings = forwards + (m * layers if acts.recompute == "selective" else 0)
        out[(CP, "ring")] += fwd * rings + bwd * m * layers
    if s.tp > 1:
        # Sublayer outputs reduced beyond two per layer forward: recompute.py's early stop
        # skips each group's last fc2 (with a tiled MLP it is off: the group reruns whole)
        extra = -acts.rerun[1] if cfg.memory.tiled_mlp_chunks == 1 else 0
        _tensor_parallel(out, cfg, s, rank, forwards, m * extra,
                         m if st.fsdp_per_block else 1)
    _zero(out, st, m)
    if dims.pp > 1:
        _pipeline_p2p(out, cfg, s, st, rank)
    _scalars(out, dims)
    return {key: int(v) for key, v in out.items() if v}


def bytes_by_kind(by_group: dict) -> dict:
    """{(group, kind): bytes} summed over groups: {kind: bytes}."""
    out = defaultdict(int)
    for (_, kind), n in by_group.items():
        out[kind] += n
    return dict(out)


def _tensor_parallel(out: dict, cfg: Config, s: _Shape, rank: _RankLayout, forwards: int,
                     extra: int, norm_syncs: int):
    """Forward: the sublayer outputs (e bytes) all-reduced, or under Megatron-SP
    reduce-scattered with the fp32 normed inputs all-gathered; backward the same kinds
    swapped (input gradients fp32). `extra`: sublayer outputs reduced beyond two per layer
    forward (negative: recomputations that stop before the last one). Plus the
    vocab-parallel embedding's and loss's collectives, and under Megatron-SP the norm
    weights' partial gradients (`norm_syncs` times). All over the tp group."""
    m, layers, frac = rank.m, rank.layers, (s.tp - 1) / s.tp
    full = s.T * s.h  # elements of [b, s/sp, h]
    outputs = 2 * forwards + extra  # sublayer outputs reduced in forward
    ag, rs, ar = (TP, "all_gather"), (TP, "reduce_scatter"), (TP, "all_reduce")
    if s.mega_sp:
        out[ag] += 2 * full * frac * (F32 * forwards + s.e * m * layers)
        out[rs] += full * frac * (s.e * outputs + 2 * F32 * m * layers)
        if cfg.memory.tiled_mlp_chunks > 1:  # a tile's recompute gathers its input again
            out[ag] += full * frac * F32 * m * layers
        norms = 2 * layers + rank.last
        out[ar] += 2 * F32 * s.h * frac * norms * norm_syncs
    else:
        out[ar] += 2 * full * frac * (s.e * outputs + 2 * F32 * m * layers)
    if rank.first:
        out[ar] += 2 * F32 * full * frac * m  # the lookup's partial sums
        if s.mega_sp:
            out[ag] += F32 * full * frac * m  # its gradient, made whole
    if rank.last:
        out[ar] += 2 * 3 * F32 * s.T * frac * m  # row max, sum of exps, picked
        if s.mega_sp:  # the loss gathers its input, backward reduce-scatters the gradient
            out[ag] += s.e * full * frac * m
            out[rs] += s.e * full * frac * m
        else:
            out[ar] += 2 * s.e * full * frac * m  # the input gradient


def _zero(out: dict, st: _States, m: int):
    """Gradients over dp x cp x sp: N ranks, each collective moving (N-1)/N of its
    buffer."""
    if st.n == 1:
        return
    frac, whole = (st.n - 1) / st.n, st.n * st.piece  # padded: what ZeRO moves
    reduce, gather = st.reduce_e / F32, st.gather_e / F32
    ar, ag, rs = (DP_SP, "all_reduce"), (DP_SP, "all_gather"), (DP_SP, "reduce_scatter")
    if st.stage == 0:
        out[ar] += 2 * st.local * reduce * frac
    elif st.stage == 1:
        out[rs] += whole * reduce * frac
        out[ag] += whole * frac
    elif not st.fsdp_per_block or st.stage == 2:
        out[rs] += (m if st.fsdp_per_block else 1) * whole * reduce * frac
        out[ag] += whole * gather * frac
    else:  # stage 3: the root once and each block twice (forward, backward) per micro-batch
        root = st.n * st.root_piece
        out[rs] += m * whole * reduce * frac
        out[ag] += m * (root + 2 * (whole - root)) * gather * frac


def _pipeline_p2p(out: dict, cfg: Config, s: _Shape, st: _States, rank: _RankLayout):
    """Each local stage sends its micro-batches' outputs forward (but the last stage) and
    input gradients backward (but the first); the tied embedding's gradient (ZeRO: its
    rows) goes between the first and the last stage."""
    sends = 2 * rank.chunks - rank.first - rank.last
    out[(PP, "p2p")] += sends * rank.m * F32 * s.Tr * s.h
    tied = not cfg.model.untie_embeddings_and_output_weights
    if tied and rank.first != rank.last:
        rows = s.V if st.stage == 0 else -(-s.V // st.n)
        out[(PP, "p2p")] += F32 * rows * s.h


def _scalars(out: dict, dims: ParallelDims):
    """The token count, the loss and the gradient norm: a few fp64 numbers."""
    ring = lambda p, nbytes: 2 * nbytes * (p - 1) / p  # noqa: E731
    out[(DP_SP, "all_reduce")] += 3 * ring(_zero_ranks(dims), 8)
    out[(PP, "all_reduce")] += 2 * ring(dims.pp, 8)
    out[(TP, "all_reduce")] += ring(dims.tp, 16)


# -- the table -------------------------------------------------------------------------------

def format_plan(plan: MemoryPlan) -> str:
    """The plan as a small table (MiB per rank), for the start-up log and --dry-run."""
    mib = lambda n: f"{n / MIB:,.1f}"  # noqa: E731
    flight = f"{plan.in_flight} micro-batch{'es' if plan.in_flight > 1 else ''} in flight"
    rows = [("parameters", plan.param_bytes), ("gradients", plan.grad_bytes),
            ("optimizer states", plan.optimizer_bytes),
            (f"activations ({flight})", plan.activation_bytes),
            ("transient working set", plan.transient_bytes),
            (f"peak ({plan.peak_moment})", plan.peak_bytes)]
    width = max(len(name) for name, _ in rows)
    lines = [f"memory plan, pipeline rank {plan.pp_rank}: {plan.layers} layers, ZeRO stage "
             f"{plan.zero_stage}, {plan.micro_batches} micro-batches of {plan.tokens} tokens "
             "per rank; MiB per rank"]
    if plan.attention:
        lines.append(f"  attention core: {plan.attention}")
    lines += [f"  {name:<{width}}  {mib(n):>12}" for name, n in rows]
    terms = ", ".join(f"{k} {mib(v)}" for k, v in plan.layer_terms.items())
    held = sum(plan.layer_terms.values())
    lines.append(f"  activations kept per layer: {mib(plan.activation_bytes_per_layer)}"
                 + (f" (recomputed, a layer holds {mib(held)} in its backward: {terms})"
                    if held != plan.activation_bytes_per_layer else f" ({terms})"))
    if plan.comm_bytes:
        lines.append("  communication per iteration, MiB sent: " + ", ".join(
            f"{k} {mib(v)}" for k, v in plan.comm_bytes.items()))
    return "\n".join(lines)
