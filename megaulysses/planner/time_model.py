"""Memory and iteration time of one grid on one kind of GPU, predicted from the config.

Memory is the memory plan (planner/memory/, the same accounting `--dry-run`
prints): the largest peak over the first and the last pipeline stage (and, with a sliding
window, over the ring ranks). A grid fits when that peak is at most the GPU's memory less
`reserve_gib` (CUDA context, NCCL buffers, cuBLAS workspace, the caching allocator's
fragmentation: what the plan's tensor bytes do not hold).

Time of one iteration, on the slowest of those stages:
  compute    hardware FLOPs / (peak * efficiency), the ring's attention at
             `ring_kernel_speed` of that (hardware.py). Per micro-batch and layer, each GPU does
             1/(tp*sp*cp) of the layer's work: matmuls 2*(h*(2q + 2kv) + h*f*(3 SwiGLU |
             2 GeLU)) FLOPs a token forward, twice that backward; attention 2*S*q*a a
             token forward (a: the fraction of the causal half it computes,
             AttentionMask.attended_fraction), 2.5 times that backward (flash attention's
             five matmuls to two); the logits 2*h*V forward, twice backward, on the last
             stage. Recomputation adds what it reruns: full, the layers' forward (the plan
             says how many); selective, the attention forward; a tiled MLP, the MLP
             forward; --attention-head-groups, the attention forward (each group is
             recomputed right before its backward).
  exposed    Ulysses all-to-alls, tensor-parallel collectives and pipeline sends wait for
             nothing to overlap them: their time is added as is; except the all-to-alls
             Ulysses issues a piece ahead (parallel/a2a_overlap.py) when its layer runs in
             n pieces (--attention-head-groups, FPDT's chunks): every piece's exchange but
             the first of each phase is in flight while another piece's attention computes,
             so of those exchanges' seconds A, (n-1)/n * min(A, attention) are hidden, the
             rest shows: A/n + (n-1)/n * max(0, A - attention). Head groups' recomputation
             exchanges, FPDT's key and value exchanges, and without pieces all of them
             show whole (`_hidden_all_to_all`). Under the ring its passes hide first.
  overlapped the ring's key/value passes hide behind the ring's attention compute (only
             what exceeds it shows); ZeRO's gradient reductions (and ZeRO-2/3's parameter
             gathers) hide behind the step's compute; ZeRO-1's all-gather after the
             optimizer step does not, unless --overlap-param-gather (the distributed
             optimizer) runs it under the next step's forward.
  bubble     1f1b and gpipe: (pp - 1) micro-batch times; interleaved: (pp - 1)/chunks;
             zero-bubble: (pp - 1)/3.
  offload    --cpu-offloading-num-layers: each offloaded input crosses the host link
             (`host_gbps`) down during the forward and back during backward; only what
             exceeds that phase's compute shows (`_offload_seconds`).
  optimizer  AdamW reads parameter, gradient and two moments and writes three of them,
             28 bytes a local fp32 parameter, at the HBM bandwidth; with
             --optimizer-cpu-offload, the host's share at `host_adam_gparams`, and its
             rows over the host link (`host_gbps`) down and back (down hidden with
             --overlap-cpu-optimizer-d2h-h2d); with --zero-param-offload all of it on
             the host, its copies, unit by unit, hidden behind the step's compute
             as far as it lasts (`_param_link_seconds`, counted with ZeRO's time).
Each (group, kind) of the plan's communication bytes (exactly what comm.py counts) crosses
the link its group spans on the mesh (pp, dp, cp, sp, tp; tp fastest): NVLink when the
group is inside a node; otherwise InfiniBand, or for an all-to-all the share of its peers
on other nodes over InfiniBand beside the rest over NVLink.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megaulysses.config import Config
from megaulysses.config.fields import filled
from megaulysses.config.rules_memory import fpdt_chunks
from megaulysses.model.attention import mask_from_config
from megaulysses.model.flops import flops_per_iteration
from megaulysses.parallel.dims import CP, DP, DP_SP, PP, SP, TP, ParallelDims
from megaulysses.planner.memory import MemoryPlan, plan_memory
from megaulysses.hardware import GPU, HOST_RESERVE, RESERVE_GIB, host_share_gib

GIB = 2 ** 30
# The fused attention backward's own buffers are planned from the kernel's source (flash's
# dq accumulator, softmax_d and GQA's expanded dk, dv; the efficient kernel's accumulator)
# but no rank measures them (training/fake_cuda.py): a grid fits with this share of them
# free beyond the plan, the tolerance the plan holds to where it is measured
UNMEASURED_MARGIN = 0.10
ATTENTION_BACKWARD = 2.5  # flash attention's backward FLOPs over its forward's
ADAM_BYTES = 28  # read p, g, m, v; write p, m, v (fp32)
EXPOSED = (SP, TP, PP)  # groups whose collectives nothing overlaps


@dataclass
class Prediction:
    """One grid on one GPU kind; times in seconds per iteration, memory in bytes."""

    memory_bytes: int  # the largest planned peak of a GPU
    memory_stage: int  # the pipeline rank that has it
    usable_bytes: int  # the GPU's memory less the reserve
    host_bytes: int  # on the host per GPU: offloaded activations and optimizer states
    host_usable_bytes: int  # the GPU's share of its node's host memory, less HOST_RESERVE
    time_s: float
    compute_s: float  # the slowest stage's compute (all micro-batches)
    exposed_comm_s: float  # communication nothing hides
    bubble_s: float
    optimizer_s: float
    tokens_per_s: float
    model_tflops: float  # per GPU, Megatron-LM's count (no recomputation)
    paper_tflops: float  # per GPU, Megatron-DeepSpeed's count (the paper's): recomputation
    # counted, attention over the whole s x s
    hardware_tflops: float  # per GPU, FLOPs executed (recomputation included)
    mfu: float  # model_tflops / peak
    comm_bytes: dict = field(default_factory=dict)  # (group, kind) -> bytes, slowest stage
    comm_s: dict = field(default_factory=dict)  # (group, kind) -> seconds on its link
    links: dict = field(default_factory=dict)  # group -> "NVLink" | "InfiniBand" | both

    margin_bytes: int = 0  # kept free beyond the plan: UNMEASURED_MARGIN of its unmeasured bytes

    @property
    def fits(self) -> bool:
        return self.memory_bytes + self.margin_bytes <= self.usable_bytes and self.fits_host

    @property
    def fits_host(self) -> bool:
        return self.host_bytes <= self.host_usable_bytes


def predict(cfg: Config, dims: ParallelDims, gpu: GPU, reserve_gib: float = RESERVE_GIB,
            device_type: str = "cuda") -> Prediction:
    """The prediction for `cfg` (validated on `dims`, vocabulary size set) on `gpu`s.
    `device_type` "cpu" plans the memory as on CPU ranks (the planner's validation)."""
    stages = sorted({0, dims.pp - 1})
    cp_ranks = range(dims.cp) if cfg.model.window_size is not None else [0]
    plans = {r: max((plan_memory(cfg, dims, r, device_type, cp_rank=c) for c in cp_ranks),
                    key=lambda p: p.peak_bytes) for r in stages}
    timed = {r: _stage_time(cfg, dims, gpu, plans[r], r) for r in stages}
    slowest = max(stages, key=lambda r: timed[r]["time"])
    t = timed[slowest]
    biggest = max(stages, key=lambda r: plans[r].peak_bytes)
    gbs, world = filled(cfg.train.global_batch_size, "--global-batch-size"), dims.world
    model_flops = flops_per_iteration(cfg.model, gbs)
    return Prediction(
        memory_bytes=plans[biggest].peak_bytes, memory_stage=biggest,
        usable_bytes=int((gpu.memory_gib - reserve_gib) * GIB),
        margin_bytes=int(UNMEASURED_MARGIN * max(p.unmeasured_bytes for p in plans.values())),
        host_bytes=max(p.host_bytes + p.offload_bytes for p in plans.values()),
        host_usable_bytes=int(host_share_gib(gpu, world) * (1 - HOST_RESERVE) * GIB), time_s=t["time"],
        compute_s=t["compute"], exposed_comm_s=t["exposed"], bubble_s=t["bubble"],
        optimizer_s=t["optimizer"], tokens_per_s=gbs * cfg.model.seq_length / t["time"],
        model_tflops=model_flops / t["time"] / world / 1e12,
        paper_tflops=megatron_deepspeed_flops(cfg) / t["time"] / world / 1e12,
        hardware_tflops=_mean_flops(timed, dims) / t["time"] / 1e12,
        mfu=model_flops / t["time"] / world / 1e12 / gpu.peak_tflops,
        comm_bytes=plans[slowest].comm_by_group, comm_s=t["comm_s"],
        links={g: link_of(dims, g, gpu) for g, _ in plans[slowest].comm_by_group})


def megatron_deepspeed_flops(cfg: Config) -> float:
    """FLOPs per iteration as Megatron-DeepSpeed prints them (the DeepSpeed-Ulysses paper's
    TFLOP/s): 24*f*B*s*L*h^2 * (1 + s/(6h) + V/(16*L*h)), f = 4 with recomputation
    (selective or full), else 3. Exact for a GPT-2 shape (ffn 4h, MHA); attention is
    counted over the whole s x s, as if not causal."""
    m, t = cfg.model, cfg.train
    f = 4 if cfg.memory.recompute_granularity else 3
    h, s, L, V = m.hidden_size, m.seq_length, m.num_layers, m.padded_vocab_size
    gbs = filled(t.global_batch_size, "--global-batch-size")
    return 24 * f * gbs * s * L * h ** 2 * (1 + s / (6 * h) + V / (16 * L * h))


def _mean_flops(timed: dict, dims: ParallelDims) -> float:
    """Hardware FLOPs per iteration of a GPU, averaged over the pipeline stages (those
    between the first and the last do what the first does)."""
    return (timed[0]["flops"] * (dims.pp - 1) + timed[dims.pp - 1]["flops"]) / dims.pp


def _stage_time(cfg: Config, dims: ParallelDims, gpu: GPU, plan: MemoryPlan,
                pp_rank: int) -> dict:
    """Seconds per iteration of pipeline rank `pp_rank`, by part (the module doc)."""
    m = plan.micro_batches
    work = _flops(cfg, dims, plan, last=pp_rank == dims.pp - 1)  # per micro-batch
    rate = gpu.peak_tflops * 1e12 * gpu.efficiency
    attention_mb = work["attention"] / rate / (gpu.ring_kernel_speed if dims.cp > 1 else 1)
    compute_mb = (work["total"] - work["attention"]) / rate + attention_mb
    comm_s = {key: comm_seconds(n, key[0], key[1], dims, gpu)
              for key, n in plan.comm_by_group.items()}
    exposed_mb = sum(s for (g, _), s in comm_s.items() if g in EXPOSED) / m
    ring_mb = sum(s for (g, _), s in comm_s.items() if g == CP) / m
    exposed_mb -= _hidden_all_to_all(cfg, dims, plan, comm_s.get((SP, "all_to_all"), 0) / m,
                                      max(0.0, attention_mb - ring_mb))
    t_mb = compute_mb + exposed_mb + max(0.0, ring_mb - attention_mb)
    par, half = cfg.parallel, cfg.train.bf16 or cfg.train.fp16
    overlap_gather = par.overlap_param_gather and par.use_distributed_optimizer and half
    zero_hidden, zero_shown = _zero_seconds(comm_s, plan.zero_stage, overlap_gather)
    zero_s = max(0.0, zero_hidden - m * compute_mb) + zero_shown + _param_link_seconds(
        plan, gpu, m * compute_mb)
    optimizer = ADAM_BYTES * _adam_params(cfg, plan) / (gpu.hbm_gbps * 1e9) + _host_step(
        cfg, plan, gpu)
    offload = m * _offload_seconds(plan, gpu, compute_mb)
    bubble = _bubble_micro_batches(cfg, dims) * (t_mb + offload / m)
    return dict(time=m * t_mb + offload + bubble + zero_s + optimizer, compute=m * compute_mb,
                exposed=m * (t_mb - compute_mb) + offload + zero_s, bubble=bubble,
                optimizer=optimizer,
                flops=m * work["total"], comm_s=comm_s)


def _hidden_all_to_all(cfg: Config, dims: ParallelDims, plan: MemoryPlan, a2a_s: float,
                       attention_s: float) -> float:
    """Seconds of a micro-batch's Ulysses all-to-alls (`a2a_s`) that its attention compute
    (`attention_s`, what the ring's passes leave) hides: with the layer in n pieces, of
    the exchanges issued a piece ahead (a2a_overlap.py; their share of the bytes below),
    (n-1)/n, at most (n-1)/n of the attention."""
    m, mem, P = cfg.model, cfg.memory, dims.sp
    hq, kv = m.num_attention_heads // dims.tp, max(m.num_kv_heads // dims.tp, P)
    chunks = fpdt_chunks(m, mem) if P > 1 else 0
    if chunks > 1:  # q and out (dout and dq) overlap; k and v (dk, dv) go first (last)
        pieces, share = chunks, hq / (hq + kv)
    elif mem.attention_head_groups > 1 and P > 1:
        pieces = mem.attention_head_groups
        # per layer, heads sent: forward (again if recomputed) and backward, each group's
        # recomputation (regroup_bytes_per_layer's: q, and k, v unless exchanged whole)
        ahead = (2 * hq + 2 * kv) * (2 * plan.layers + plan.recomputed_layers)
        again = (hq + (2 * kv if (kv // P) % pieces == 0 else 0)) * plan.layers
        share = ahead / (ahead + again)
    else:
        return 0.0
    return (pieces - 1) / pieces * min(share * a2a_s, attention_s)


def _flops(cfg: Config, dims: ParallelDims, plan: MemoryPlan, last: bool) -> dict:
    """Hardware FLOPs of one micro-batch on one GPU of the stage: total and attention."""
    mc, b = cfg.model, cfg.train.micro_batch_size
    h, S, f = mc.hidden_size, mc.seq_length, mc.ffn_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    tokens = b * S / (dims.tp * dims.sp * dims.cp)  # this GPU's share of the work
    mlp = 2 * h * f * (3 if mc.swiglu else 2)
    gemm = 2 * h * (2 * q + 2 * kv) + mlp  # a token's matmuls, forward
    attn = 2 * S * q * mask_from_config(mc).attended_fraction(S)  # forward, causal half
    layers = plan.layers
    mem = cfg.memory
    rerun = {"full": plan.recomputed_layers * (gemm + attn),
             "selective": layers * attn}.get(mem.recompute_granularity or "none", 0)
    if mem.tiled_mlp_chunks > 1:
        rerun += layers * mlp
    # head groups: each group's core runs forward once more, right before its backward
    # (under selective recomputation that is the one it does anyway)
    groups = mem.attention_head_groups > 1 and mem.recompute_granularity != "selective"
    if groups:
        rerun += layers * attn
    head = 2 * h * mc.padded_vocab_size if last else 0
    total = tokens * (3 * (layers * gemm + head) + (1 + ATTENTION_BACKWARD) * layers * attn
                      + rerun)
    attention = tokens * layers * attn * (1 + ATTENTION_BACKWARD + int(groups) + (
        1 if mem.recompute_granularity in ("full", "selective") else 0))
    return dict(total=total, attention=attention)


def _adam_params(cfg: Config, plan: MemoryPlan) -> float:
    """Parameters AdamW steps on this rank: its moments' bytes / 8 (the distributed
    optimizer's states hold the fp32 main weights too: / 12)."""
    half = cfg.train.bf16 or cfg.train.fp16
    dist_opt = cfg.parallel.use_distributed_optimizer and half and plan.zero_stage <= 1
    return plan.optimizer_bytes / (12 if dist_opt else 8)


def _host_step(cfg: Config, plan: MemoryPlan, gpu: GPU) -> float:
    """--optimizer-cpu-offload: the gradient rows to the host, AdamW there, the updated
    rows back. With --overlap-cpu-optimizer-d2h-h2d the copy down hides behind the
    reductions still in flight; the host's step and the copy back do not."""
    if not plan.host_bytes:
        return 0.0
    link = plan.host_link_bytes / (gpu.host_gbps * 1e9)
    adam = plan.host_bytes / 16 / (gpu.host_adam_gparams * 1e9)  # 16 bytes a parameter
    return adam + link * (1 if cfg.parallel.overlap_cpu_optimizer_d2h_h2d else 2)


def _param_link_seconds(plan: MemoryPlan, gpu: GPU, compute_s: float) -> float:
    """--zero-param-offload: what of the units' copies over the host link (`host_gbps`;
    each unit's shard up before its all-gather, its reduced gradient shard down) the
    step's compute does not hide. FSDP2 issues them with the prefetched all-gathers and
    the reduce-scatters, on another link than those (the collectives' term is apart)."""
    return max(0.0, plan.param_link_bytes / (gpu.host_gbps * 1e9) - compute_s)


def _offload_seconds(plan: MemoryPlan, gpu: GPU, compute_mb: float) -> float:
    """--cpu-offloading-num-layers, per micro-batch: what of the copies over the host link
    (`host_gbps`) the compute does not hide. The inputs go down while the forward runs
    (each behind the next group's forward) and come back while recomputation and backward
    run (each one group ahead): under full recomputation the forward is ~1/4 of a
    micro-batch's compute (forward, forward again, backward twice), the rest ~3/4."""
    if not plan.offload_link_bytes:
        return 0.0
    copy = plan.offload_link_bytes / plan.micro_batches / (gpu.host_gbps * 1e9)  # each way
    return max(0.0, copy - compute_mb / 4) + max(0.0, copy - 3 * compute_mb / 4)


def _zero_seconds(comm_s: dict, stage: int, overlap_gather: bool) -> tuple[float, float]:
    """(seconds the step's compute can hide, seconds it cannot) of dp x cp x sp's
    collectives: the gradient reductions overlap backward; ZeRO-2/3 gather parameters
    ahead of their use; ZeRO-1 gathers the updated ones after the optimizer step, unless
    --overlap-param-gather runs them under the next forward."""
    hidden = shown = 0.0
    for (group, kind), s in comm_s.items():
        if group != DP_SP:
            continue
        if kind == "all_gather" and stage == 1 and not overlap_gather:
            shown += s
        else:
            hidden += s
    return hidden, shown


def _bubble_micro_batches(cfg: Config, dims: ParallelDims) -> float:
    """Micro-batch times the pipeline spends filling and draining."""
    if dims.pp == 1:
        return 0.0
    schedule = cfg.parallel.pipeline_schedule or "1f1b"
    if schedule == "interleaved-1f1b":
        return (dims.pp - 1) / plan_chunks(cfg, dims)
    if schedule == "zero-bubble":
        return (dims.pp - 1) / 3
    return float(dims.pp - 1)


def plan_chunks(cfg: Config, dims: ParallelDims) -> int:
    """Model chunks per pipeline rank (virtual stages)."""
    v = cfg.parallel.num_layers_per_virtual_pipeline_stage
    return max(1, cfg.model.num_layers // (v * dims.pp)) if v else 1


# -- where each group's bytes go ---------------------------------------------------------------

def group_span(dims: ParallelDims, group: str) -> tuple[int, int]:
    """(ranks, stride between consecutive ranks) of a `group` of the mesh (pp, dp, cp, sp,
    tp), tp fastest-varying; dp_sp is dp x cp x sp flattened (stride tp)."""
    return {TP: (dims.tp, 1), SP: (dims.sp, dims.tp), CP: (dims.cp, dims.tp * dims.sp),
            DP: (dims.dp, dims.tp * dims.sp * dims.cp),
            DP_SP: (dims.dp * dims.cp * dims.sp, dims.tp),
            PP: (dims.pp, dims.world // dims.pp)}[group]


def _on_one_node(dims: ParallelDims, group: str, gpus_per_node: int) -> tuple[int, int]:
    """(ranks of the group, of them on one node)."""
    size, stride = group_span(dims, group)
    if dims.world <= gpus_per_node:
        return size, size
    return size, min(size, max(1, gpus_per_node // stride))


def link_of(dims: ParallelDims, group: str, gpu: GPU) -> str:
    size, local = _on_one_node(dims, group, gpu.gpus_per_node)
    return "NVLink" if local >= size else "InfiniBand" if local == 1 else "NVLink+InfiniBand"


def comm_seconds(nbytes: float, group: str, kind: str, dims: ParallelDims, gpu: GPU) -> float:
    """Seconds to send `nbytes` (what this rank sends, comm.py's count) in a `kind`
    collective over `group`: NVLink inside a node; across nodes a ring collective or a
    point-to-point pass is as fast as its slowest hop, InfiniBand; an all-to-all sends
    (local - 1)/(size - 1) of its bytes over NVLink and the rest over InfiniBand at once."""
    size, local = _on_one_node(dims, group, gpu.gpus_per_node)
    if nbytes == 0 or size == 1:
        return 0.0
    nvlink, ib = gpu.nvlink_gbps * 1e9, gpu.ib_gbps * 1e9
    if local >= size:
        return nbytes / nvlink
    if kind == "all_to_all":
        return max(nbytes * (local - 1) / (size - 1) / nvlink,
                   nbytes * (size - local) / (size - 1) / ib)
    return nbytes / ib
