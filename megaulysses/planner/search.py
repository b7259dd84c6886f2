"""Every grid of a model on N GPUs, checked and predicted; the fastest that fit first.

A grid is (tp, pp, sp, cp; dp = N / (tp*pp*sp*cp)), the ZeRO stage (and last ZeRO-3 with
the parameters on the host, --zero-param-offload), the recomputation
(none, selective, full, full with the MLP tiled by 4; for long sequences full with the
inputs offloaded to host, the MLP by 4, 16 or 32 and attention by 1, 2 or 4 groups of
heads, then by FPDT's sequence chunks of 64K or 16K tokens)
and the micro-batch. Each is checked
by the trainer's own rules (`config.validate`, `config.resolve`): a grid the
trainer would refuse is rejected with the trainer's message. With tp > 1 Megatron-SP
(--sequence-parallel) is searched both ways unless the flags hold it, and shown in the
grid; tp stays inside a node.

The search does not predict what it can rule out: for a fixed (tp, pp, sp, cp, micro-batch)
it walks the recomputation levels from the lightest, and at each level the ZeRO stages from
0 up to the first that fits; a heavier level then only tries the stages below that one
(more recomputation at the same or a higher ZeRO stage cannot be faster). Those not tried
are counted as dominated.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterator, Optional

from megaulysses.config import Config, ConfigError, RunConfig, resolve, validate
from megaulysses.config.fields import filled
from megaulysses.hardware import GPU, RESERVE_GIB
from megaulysses.planner.time_model import Prediction, predict

# (recompute, MLP tiles, activation offload, attention head groups, FPDT's chunk: tokens of
# the whole sequence, 0 off), lightest first. FPDT (--ds-sequence-parallel-fpdt) last: the
# other way of cutting attention's working set (not with head groups), in sequence chunks
# whose merge and (sp > 1) per-chunk exchanges cost more than head groups' heads
LEVELS = (("none", 1, False, 1, 0), ("selective", 1, False, 1, 0), ("full", 1, False, 1, 0),
          ("full", 4, False, 1, 0), ("full", 4, True, 1, 0), ("full", 16, True, 1, 0),
          ("full", 32, True, 1, 0), ("full", 16, True, 2, 0), ("full", 16, True, 4, 0),
          ("full", 32, True, 4, 0), ("full", 32, True, 1, 65536), ("full", 32, True, 1, 16384))
ZERO_STAGES = (0, 1, 2, 3)
MICRO_BATCHES = (1, 2, 4, 8)
FIELDS = ("tp", "pp", "sp", "cp", "zero", "recompute", "tiles", "micro_batch", "megatron_sp",
          "dist_opt", "offload", "head_groups", "param_offload")


@dataclass(frozen=True)
class Grid:
    dp: int
    tp: int
    pp: int
    sp: int
    cp: int
    zero: int
    recompute: str  # none | selective | full
    tiles: int  # --tiled-mlp-chunks
    micro_batch: int
    megatron_sp: bool = False  # --sequence-parallel: Megatron's sequence parallelism in tp
    dist_opt: bool = False  # --use-distributed-optimizer (with zero 1)
    offload: int = 0  # --cpu-offloading-num-layers (the planner offloads a whole stage)
    head_groups: int = 1  # --attention-head-groups
    param_offload: bool = False  # --zero-param-offload (with zero 3): ZeRO-3's shards on the host
    fpdt: int = 0  # --ds-sequence-parallel-fpdt-chunk-size with --ds-sequence-parallel-fpdt

    def flags(self) -> list[str]:
        """The pretrain_gpt.py flags of this grid."""
        out = ["--tensor-model-parallel-size", str(self.tp),
               "--pipeline-model-parallel-size", str(self.pp),
               "--ds-sequence-parallel-size", str(self.sp),
               "--context-parallel-size", str(self.cp), "--zero-stage", str(self.zero),
               "--micro-batch-size", str(self.micro_batch)]
        out += ["--sequence-parallel"] if self.megatron_sp else []
        out += ["--use-distributed-optimizer"] if self.dist_opt else []
        out += ["--zero-param-offload"] if self.param_offload else []
        out += ["--recompute-granularity", self.recompute] if self.recompute != "none" else []
        out += ["--cpu-offloading-num-layers", str(self.offload)] if self.offload else []
        out += ["--attention-head-groups", str(self.head_groups)] if self.head_groups > 1 else []
        out += (["--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size",
                 str(self.fpdt)] if self.fpdt else [])
        return out + (["--tiled-mlp-chunks", str(self.tiles)] if self.tiles > 1 else [])

    def __str__(self) -> str:
        return (f"dp {self.dp} x tp {self.tp} x pp {self.pp} x sp {self.sp} x cp {self.cp}, "
                f"{'Megatron-SP, ' if self.megatron_sp else ''}"
                f"{'distributed optimizer' if self.dist_opt else f'ZeRO-{self.zero}'}"
                f"{', params on host' if self.param_offload else ''}, "
                f"recompute {self.recompute}"
                f"{f', MLP tiles {self.tiles}' if self.tiles > 1 else ''}"
                f"{f', activations offloaded ({self.offload} layers a stage)' if self.offload else ''}"
                f"{f', head groups {self.head_groups}' if self.head_groups > 1 else ''}"
                f"{f', FPDT chunks {self.fpdt}' if self.fpdt else ''}, "
                f"micro-batch {self.micro_batch}")


@dataclass
class Candidate:
    grid: Grid
    prediction: Optional[Prediction] = None
    reason: Optional[str] = None  # why it was rejected (None: it fits)
    kind: str = "fits"  # fits | invalid | memory


@dataclass
class SearchResult:
    ranked: list  # Candidates that fit, fastest first
    rejected: list  # invalid or too big
    dominated: int  # not predicted: a lighter setting of the same grid fits
    gpus: int = 0
    gpu: Optional[GPU] = None

    def reasons(self) -> list[tuple[str, int, str]]:
        """(what, how many, an example) per reason, most frequent first."""
        counts = Counter(_reason_key(c) for c in self.rejected)
        example: dict[str, Candidate] = {}
        for c in self.rejected:
            example.setdefault(_reason_key(c), c)
        return [(key, n, f"{example[key].grid}: {example[key].reason}")
                for key, n in counts.most_common()]

    def faster_rejected(self, n: int = 3) -> list:
        """Grids predicted faster than the best that fits, rejected for memory."""
        best = self.ranked[0].prediction.time_s if self.ranked else float("inf")
        big = [c for c in self.rejected if c.kind == "memory" and c.prediction.time_s < best]
        return sorted(big, key=lambda c: c.prediction.time_s)[:n]


def _reason_key(c: Candidate) -> str:
    return "does not fit in memory" if c.kind == "memory" else _flag_of(c)


def _flag_of(c: Candidate) -> str:
    """The flag a rejected candidate's reason names ("" for one that fits)."""
    return (c.reason or "").split(":")[0]


def configure(base: Config, grid: Grid) -> RunConfig:
    """`base` with `grid`'s flags, checked and resolved as the trainer does (ConfigError).
    `base.model.vocab_size`: the tokenizer's."""
    full = grid.recompute == "full"
    par = replace(base.parallel, tensor_model_parallel_size=grid.tp,
                  pipeline_model_parallel_size=grid.pp, ds_sequence_parallel_size=grid.sp,
                  context_parallel_size=grid.cp, tp_sequence_parallel=grid.megatron_sp,
                  zero_stage=grid.zero, use_distributed_optimizer=grid.dist_opt,
                  zero_param_offload=grid.param_offload)
    mem = replace(base.memory, tiled_mlp_chunks=grid.tiles, attention_head_groups=grid.head_groups,
                  cpu_offloading_num_layers=grid.offload,
                  recompute_granularity=None if grid.recompute == "none" else grid.recompute,
                  recompute_method=(base.memory.recompute_method or "uniform") if full else None,
                  recompute_num_layers=(base.memory.recompute_num_layers or 1) if full else None)
    if grid.fpdt:  # else as the flags have it
        mem = replace(mem, ds_sequence_parallel_fpdt=True,
                      ds_sequence_parallel_fpdt_chunk_size=grid.fpdt)
    cfg = Config(model=base.model, data=base.data, log=base.log, parallel=par, memory=mem,
                 train=replace(base.train, micro_batch_size=grid.micro_batch))
    validate(cfg)
    return resolve(cfg, grid.dp * grid.tp * grid.pp * grid.sp * grid.cp, base.model.vocab_size)


def evaluate(base: Config, grid: Grid, gpu: GPU, reserve_gib: float,
             device_type: str = "cuda") -> Candidate:
    """One grid: rejected by the trainer's rules, or predicted (and fitting or not)."""
    if grid.tp > gpu.gpus_per_node:
        return Candidate(grid, reason=f"--tensor-model-parallel-size: {grid.tp} spans nodes "
                         f"(tp stays within the {gpu.gpus_per_node} GPUs of a node)",
                         kind="invalid")
    try:
        cfg = configure(base, grid)
    except ConfigError as e:
        return Candidate(grid, reason=str(e), kind="invalid")
    p = predict(cfg, cfg.dims, gpu, reserve_gib, device_type)
    if not p.fits_host:
        return Candidate(grid, p, reason=f"needs {p.host_bytes / 2 ** 30:.1f} GiB of host "
                         f"memory per GPU, {p.host_usable_bytes / 2 ** 30:.1f} usable "
                         "(--host-memory-gib)", kind="memory")
    if not p.fits:
        margin = f" (+{p.margin_bytes / 2 ** 30:.1f} margin)" if p.margin_bytes else ""
        return Candidate(grid, p, reason=f"needs {p.memory_bytes / 2 ** 30:.1f} GiB{margin} on "
                         f"pipeline rank {p.memory_stage}, {p.usable_bytes / 2 ** 30:.1f} "
                         "usable", kind="memory")
    return Candidate(grid, p)


def search(base: Config, gpus: int, gpu: GPU, fixed: Optional[dict] = None,
           reserve_gib: float = RESERVE_GIB) -> SearchResult:
    """Every grid of `base`'s model on `gpus` GPUs; `fixed` holds some of FIELDS at the
    given values (the flags the user gave)."""
    fixed = dict(fixed or {})
    if base.parallel.zero_param_offload:  # asked for: held, as the grid flags are
        fixed.setdefault("param_offload", True)
    ranked, rejected, dominated = [], [], 0
    for shape in _shapes(gpus, base, fixed):
        for mb in _micro_batches(base, shape[0], fixed):
            for megatron_sp in _megatron_sp(shape[1], fixed):
                fits, tried, skipped = _walk(base, shape, mb, megatron_sp, gpu, reserve_gib,
                                             fixed)
                ranked += fits
                rejected += tried
                dominated += skipped
    ranked.sort(key=lambda c: c.prediction.time_s)
    return SearchResult(ranked, rejected, dominated, gpus, gpu)


def _shapes(gpus: int, base: Config, fixed: dict) -> Iterator[tuple]:
    """(dp, tp, pp, sp, cp) with the product of the last four dividing `gpus`."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    pick = lambda name, options: [fixed[name]] if name in fixed else options  # noqa: E731
    layers = base.model.num_layers
    for tp in pick("tp", [d for d in divisors if d <= base.model.num_attention_heads]):
        for pp in pick("pp", [d for d in divisors if d <= layers]):
            for sp in pick("sp", divisors):
                for cp in pick("cp", divisors):
                    if gpus % (tp * pp * sp * cp) == 0:
                        yield gpus // (tp * pp * sp * cp), tp, pp, sp, cp


def _megatron_sp(tp: int, fixed: dict) -> list[bool]:
    """Megatron-SP off and on under tp > 1 (less memory, the same bytes: it may still lose
    where the plan's activations do not bind), or as the flags hold it."""
    if tp == 1:
        return [False]
    return [fixed["megatron_sp"]] if "megatron_sp" in fixed else [False, True]


def _micro_batches(base: Config, dp: int, fixed: dict) -> list[int]:
    if "micro_batch" in fixed:
        return [fixed["micro_batch"]]
    gbs = filled(base.train.global_batch_size, "--global-batch-size")  # search's caller sets it
    per_dp = gbs // dp if gbs % dp == 0 else 1
    return [b for b in MICRO_BATCHES if per_dp % b == 0] or [1]


def _walk(base: Config, shape: tuple, mb: int, megatron_sp: bool, gpu: GPU,
          reserve_gib: float, fixed: dict) -> tuple[list, list, int]:
    """(fitting, rejected, dominated) of one shape and micro-batch over the recomputation
    levels and ZeRO stages (the module doc's order)."""
    dp, tp, pp, sp, cp = shape
    stages = _stages(base, dp * cp * sp, fixed, alone=dp * tp * pp * sp * cp == 1)
    held = dict(fixed, offload=bool(fixed["offload"])) if "offload" in fixed else fixed
    # strict=False: a level's fifth item (FPDT's chunk) is no fixable field; the first four are
    levels = [level for level in _levels(base, fixed) if all(held.get(k, v) == v for k, v
              in zip(("recompute", "tiles", "offload", "head_groups"), level, strict=False))]
    if "tiles" in fixed and not levels:  # a tile count LEVELS does not list
        levels = [(r, fixed["tiles"], o, g, c) for r, _, o, g, c in _levels(base, fixed)
                  if fixed.get("recompute", r) == r and held.get("offload", o) == o
                  and fixed.get("head_groups", g) == g]
        levels = list(dict.fromkeys(levels))
    fits, rejected, limit, tried = [], [], len(stages), 0
    for recompute, tiles, offload, groups, chunk in levels:
        for i, (zero, dist_opt, host) in enumerate(stages[:limit]):
            layers = fixed.get("offload") or base.model.num_layers // pp
            grid = Grid(dp, tp, pp, sp, cp, zero, recompute, tiles, mb, megatron_sp, dist_opt,
                        layers if offload else 0, groups, host, chunk)
            c = evaluate(base, grid, gpu, reserve_gib)
            if offload and "offload" not in fixed:
                c = _fewer_offloaded(base, c, gpu, reserve_gib)
            tried += 1
            if c.kind == "fits":
                fits.append(c)
                limit = i
                break
            rejected.append(c)
            if c.kind == "invalid" and not _depends_on_level(c):
                return fits, rejected, 0  # the shape itself is invalid: nothing else fits
        if limit == 0:
            break
    return fits, rejected, len(levels) * len(stages) - tried


def _fewer_offloaded(base: Config, c: Candidate, gpu: GPU, reserve_gib: float) -> Candidate:
    """`c` (every layer's input of a stage offloaded), or where that outgrows the host's
    share, the same grid with the most layers offloaded that the host holds: the rest
    stay on the device. Host bytes grow by one input per offloaded layer, so the count
    follows from the host bytes with none offloaded; device bytes only grow as it falls,
    so a grid already too big for the device is left as it is."""
    p = c.prediction
    if c.kind != "memory" or p is None or p.fits_host or (
            p.memory_bytes + p.margin_bytes > p.usable_bytes):
        return c  # (a "memory" candidate always has its prediction)
    none = evaluate(base, replace(c.grid, offload=0), gpu, reserve_gib)
    if none.prediction is None or not none.prediction.fits_host:
        return c
    per_layer = (p.host_bytes - none.prediction.host_bytes) / c.grid.offload
    n = min(c.grid.offload - 1,
            int((p.host_usable_bytes - none.prediction.host_bytes) // per_layer))
    if n <= 0:
        return none if none.kind == "fits" else c
    trial = evaluate(base, replace(c.grid, offload=n), gpu, reserve_gib)
    return trial if trial.prediction is not None else c


def _stages(base: Config, n: int, fixed: dict, alone: bool = False
            ) -> list[tuple[int, bool, bool]]:
    """(ZeRO stage, distributed optimizer, parameters on the host) in the walk's order.
    Under --bf16/--fp16 Megatron-LM's distributed optimizer (16-bit weights, fp32 main
    rows) comes before ZeRO-1: less memory and no more time (the same reduce-scatter, a
    16-bit all-gather), so ZeRO-1 is tried only where it does not fit; under fp32 it is
    ZeRO-1. Last "3 + host" (--zero-param-offload): ZeRO-3 with the shards, gradients and
    AdamW on the host, the least device memory and the most time (the host link, the
    host's step), so the walk's dominance holds. On one data x sequence rank no ZeRO,
    except 3 + host where that rank is the whole job (`alone`: FSDP2 over a world-1
    group; beside tp or pp ranks the trainer refuses it). As the flags hold them."""
    half = base.train.bf16 or base.train.fp16
    ladder = [(0, False, False)] + ([(1, True, False)] if half else []) + [
        (1, False, False), (2, False, False), (3, False, False), (3, False, True)]
    if n == 1:
        ladder = [(0, False, False)] + ([(3, False, True)] if alone else [])
    if fixed.get("dist_opt"):
        return [(max(1, fixed.get("zero", 1)), fixed.get("zero", 1) <= 1, False)]
    return [(z, d, h) for z, d, h in ladder if fixed.get("zero", z) == z
            and fixed.get("dist_opt", d) == d and fixed.get("param_offload", h) == h]


def _levels(base: Config, fixed: dict) -> tuple:
    """LEVELS; without FPDT's where the flags hold attention's cut (FPDT or head groups
    given: those levels run as the flags say) or a chunk would not cut the sequence."""
    mem = base.memory
    if mem.ds_sequence_parallel_fpdt or "head_groups" in fixed:
        return tuple(level for level in LEVELS if not level[4])
    return tuple(level for level in LEVELS if level[4] < base.model.seq_length)


def _depends_on_level(c: Candidate) -> bool:
    """A rule that another recomputation level or ZeRO stage could still satisfy (else
    the shape itself is invalid, counted once)."""
    return _flag_of(c) in ("--recompute-num-layers", "--tiled-mlp-chunks", "--zero-stage",
                           "--attention-head-groups", "--cpu-offloading-num-layers",
                           "--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size")
