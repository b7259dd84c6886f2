"""Pipeline schedules: per-stage busy and idle time, bubble vs theory, activation memory.

One GPT (Llama style, 8 layers, h 512, 8 heads, seq 512, vocab 8192, fp32) trains one
step of m = 8 micro-batches of 2 samples on pp = 2 and 4 gloo ranks (spawned processes,
one torch thread each) with each schedule of megaulysses.parallel.pipeline:

    gpipe             all forwards, then all backwards; one stage per rank
    1f1b              one forward one backward in steady state; one stage per rank
    interleaved-1f1b  two virtual stages per rank (stage s on rank s % pp)
    zero-bubble       torch's ZB1P (ScheduleInterleavedZeroBubble), one stage per rank:
                      backward split into input and weight gradients, the weight part
                      filling the bubble

Baseline, in the same run: the same model and micro-batches on one rank without a
pipeline (the trainer's plain loop), for the speed-up of each schedule.

Timed: `Pipeline.step` (forward, loss, backward of every micro-batch; no optimizer step),
after a barrier; a rep's step time is the slowest rank's; median over --reps after
--warmup. Per rank, busy = CPU time (thread time: compute only, not waits, not time
spent descheduled) inside the stage's forward and backward calls; idle = step - busy;
bubble = idle / step. Theory for one stage per rank, (p - 1) / (m + p - 1) of the step
(gpipe and 1f1b alike); interleaved with v virtual stages (p - 1) / (v m + p - 1);
ZB1P's ideal is below 1f1b's (weight gradients fill part of the bubble), no closed form.
On fewer cores than ranks (pp 4 on 2 cores) idle also holds time a rank waited for a core
its neighbours were using: the bubble reads higher than the schedule's.

Activation memory: the bytes of tensors autograd saves for backward (parameters
excluded, each storage counted once), tracked with saved-tensor hooks; peak per rank
over the step. "in flight" = peak / (gpipe's peak / m): micro-batches whose activations
the stage holds at once (1f1b: at most pp - rank; gpipe: m).

    python benchmarks/pipeline.py                            # the full default
    python benchmarks/pipeline.py --hidden 128 --seq 128     # a quicker one
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import launch, table  # noqa: E402

from megaulysses.config import ModelConfig, ParallelConfig, pipeline_layout  # noqa: E402
from megaulysses.model.attention import select_backend  # noqa: E402
from megaulysses.model.gpt import GPT, build_model  # noqa: E402
from megaulysses.parallel.comm import Comm  # noqa: E402
from megaulysses.parallel.dims import PP, ParallelDims, build_mesh  # noqa: E402
from megaulysses.parallel.pipeline import (Pipeline, keep_stages, local_stages,  # noqa: E402
                                           stage_modules)

# The Llama-style architecture (the ModelConfig defaults are Megatron-LM's GPT-2 style).
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8, help="m per step")
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    for pp in args.pp:
        if args.layers % (2 * pp) or args.micro_batches % pp:
            p.error(f"--layers must divide by 2*pp and --micro-batches by pp (pp={pp})")
    return args


def model_config(args) -> ModelConfig:
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, seq_length=args.seq,
                       vocab_size=args.vocab, **LLAMA)


def micro_batches(args) -> list[dict]:
    """The same random micro-batches on every rank (and for the baseline)."""
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.micro_batches):
        data = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
        out.append({"tokens": data[:, :-1], "labels": data[:, 1:],
                    "loss_mask": torch.ones(args.micro_batch, args.seq),
                    "position_ids": torch.arange(args.seq).expand(args.micro_batch, -1)})
    return out


# -- activation memory ----------------------------------------------------------------


class _Held:
    """A saved tensor; tells the tracker when autograd lets go of it."""

    def __init__(self, t, tracker, key):
        self.t, self.tracker, self.key = t, tracker, key

    def __del__(self):
        self.tracker.release(self.key)


class SavedActivations:
    """Peak bytes of tensors saved for backward, parameters excluded, storages once."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict = {}  # storage pointer -> [bytes, references]
        self.now = self.peak = 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return t
        entry = self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Held(t, self, key)

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def hooks(self):
        self.now = self.peak = 0
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


# -- one rank -------------------------------------------------------------------------


def _instrument(stage, busy: list):
    """Add the CPU time of the stage's compute calls to busy[0]."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        original = getattr(stage, name)

        def timed(*a, _original=original, **k):
            t0 = time.thread_time()
            try:
                return _original(*a, **k)
            finally:
                busy[0] += time.thread_time() - t0
        setattr(stage, name, timed)


def build_pipeline(args, comm: Comm, schedule: str):
    cfg = model_config(args)
    pp = comm.size(PP)
    virtual = 2 if schedule == "interleaved-1f1b" else None
    par = ParallelConfig(pipeline_model_parallel_size=pp, pipeline_schedule=schedule,
                         num_layers_per_virtual_pipeline_stage=(
                             args.layers // (2 * pp) if virtual else None))
    layout = pipeline_layout(cfg.num_layers, par)
    stages = local_stages(len(layout), pp, comm.rank(PP))
    _, core = select_backend("auto", torch.device("cpu"))
    with torch.device("meta"):
        model = keep_stages(GPT(cfg, core), layout, stages)
        modules = stage_modules(model, layout, stages, torch.float32)
    model.to_empty(device="cpu")
    model.init_weights(args.seed)
    shape = (args.micro_batch, args.seq, args.seq, args.hidden, torch.float32)
    return model, Pipeline(model, comm, layout, schedule, args.micro_batches, shape,
                           torch.device("cpu"), modules), len(layout) // pp


def run_schedule(args, comm: Comm, schedule: str, batches) -> dict:
    model, pipeline, virtual = build_pipeline(args, comm, schedule)
    busy = [0.0]
    for stage in pipeline.stages:
        _instrument(stage, busy)
    tracker = SavedActivations(model.parameters())
    tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    out = {"step": [], "busy": [], "peak": [], "virtual": virtual}
    for rep in range(args.warmup + args.reps):
        model.zero_grad(set_to_none=True)
        busy[0] = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        with tracker.hooks():
            loss = pipeline.step(batches, [1.0 / tokens] * len(batches))
        elapsed = time.perf_counter() - t0
        if rep >= args.warmup:
            out["step"].append(elapsed)
            out["busy"].append(busy[0])
            out["peak"].append(tracker.peak)
    out["loss"] = loss / tokens if pipeline.has_last else None
    return out


def run_rank(rank: int, pp: int, args) -> dict:
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=1, pp=pp, sp=1), "cpu"))
    torch.set_num_threads(1)
    batches = micro_batches(args)
    return {s: run_schedule(args, comm, s, batches) for s in args.schedules}


def baseline(args) -> dict:
    """One rank, no pipeline: the trainer's loop over the same micro-batches."""
    torch.set_num_threads(1)
    _, core = select_backend("auto", torch.device("cpu"))
    model = build_model(model_config(args), core, args.seed)
    batches = micro_batches(args)
    tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    tracker = SavedActivations(model.parameters())
    times, peak = [], 0
    for rep in range(args.warmup + args.reps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        total = 0.0
        with tracker.hooks():
            for b in batches:
                losses = model(b["tokens"], b["position_ids"], b["labels"])
                micro = (losses * b["loss_mask"]).sum()
                (micro / tokens).backward()
                total += float(micro.detach())
        if rep >= args.warmup:
            times.append(time.perf_counter() - t0)
            peak = max(peak, tracker.peak)
    return {"step": statistics.median(times), "peak": peak, "loss": total / tokens}


# -- report ---------------------------------------------------------------------------


def theory(pp: int, m: int, schedule: str, virtual: int) -> str:
    if schedule == "zero-bubble":
        return f"< {100 * (pp - 1) / (m + pp - 1):.1f}"
    return f"{100 * (pp - 1) / (virtual * m + pp - 1):.1f}"


def summarize(pp: int, ranks: list[dict], args) -> dict:
    rows = {}
    for schedule in args.schedules:
        per_rank = [r[schedule] for r in ranks]
        steps = [max(r["step"][i] for r in per_rank) for i in range(args.reps)]
        i = steps.index(statistics.median_low(steps))  # the median rep, every rank in it
        busy = [r["busy"][i] for r in per_rank]
        rows[schedule] = {"step": steps[i], "busy": busy,
                          "peak": [max(r["peak"]) for r in per_rank],
                          "virtual": per_rank[0]["virtual"],
                          "loss": next(r["loss"] for r in per_rank if r["loss"] is not None)}
    return rows


def report(results: dict, base: dict, args, wall: float) -> str:
    m, mib = args.micro_batches, 2 ** 20
    lines = [f"Pipeline step: {args.layers} layers, h {args.hidden}, {args.heads} heads, seq "
             f"{args.seq}, vocab {args.vocab}, m = {m} micro-batches of {args.micro_batch}, "
             f"fp32, gloo; median of {args.reps} reps after {args.warmup} warm-up",
             f"{len(os.sched_getaffinity(0))} CPU cores, 1 thread per rank; busy = CPU time "
             "in the stage's forward/backward calls; bubble = idle / step", ""]
    rows = []
    for pp, res in results.items():
        for schedule, r in res.items():
            gpipe_peak = res["gpipe"]["peak"] if "gpipe" in res else None
            for rank in range(pp):
                idle = r["step"] - r["busy"][rank]
                flight = (f"{r['peak'][rank] / (gpipe_peak[rank] / m):.1f}" if gpipe_peak
                          else "-")
                rows.append([pp, schedule, rank, f"{r['step']:.2f}", f"{r['busy'][rank]:.2f}",
                             f"{idle:.2f}", f"{100 * idle / r['step']:.1f}",
                             theory(pp, m, schedule, r["virtual"]),
                             f"{r['peak'][rank] / mib:.1f}", flight])
    lines.append(table(["pp", "schedule", "rank", "step s", "busy s", "idle s", "bubble %",
                        "theory %", "peak act MiB", "in flight"], rows))
    lines += ["", f"baseline, 1 rank, no pipeline: {base['step']:.2f} s/step, peak activations "
              f"{base['peak'] / mib:.1f} MiB, loss {base['loss']:.6f}", "",
              "ratios (step time: baseline / schedule = speed-up; peak activations of the "
              "busiest rank vs gpipe's):"]
    rows = []
    for pp, res in results.items():
        for schedule, r in res.items():
            mem = (f"{max(r['peak']) / max(res['gpipe']['peak']):.2f}" if "gpipe" in res
                   else "-")
            rows.append([pp, schedule, f"{base['step'] / r['step']:.2f}",
                         f"{res['gpipe']['step'] / r['step']:.2f}" if "gpipe" in res else "-",
                         mem, f"{r['loss']:.6f}"])
    lines.append(table(["pp", "schedule", "speed-up vs 1 rank", "speed vs gpipe",
                        "peak act vs gpipe", "loss"], rows))
    losses = [r["loss"] for res in results.values() for r in res.values()] + [base["loss"]]
    spread = max(losses) - min(losses)
    lines.append(f"same loss everywhere (fp32, 1e-5): {'yes' if spread < 1e-5 else 'NO'} "
                 f"(spread {spread:.1e})")
    lines.append(f"total wall time: {wall:.0f} s")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    base = baseline(args)
    print(f"baseline done in {time.perf_counter() - start:.0f} s", flush=True)
    results = {}
    for pp in args.pp:
        t0 = time.perf_counter()
        results[pp] = summarize(pp, launch(run_rank, pp, args, timeout=args.timeout), args)
        print(f"pp={pp} done in {time.perf_counter() - t0:.0f} s", flush=True)
    print()
    print(report(results, base, args, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
