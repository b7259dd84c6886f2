"""What a run tells its user: the start-up lines (model, grid, ZeRO, memory plan,
pipeline), one line (and metrics record) per --log-interval iterations, and each
--tensorboard-log-interval-th iteration's scalars for tensorboard and wandb."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from megaulysses.config.fields import filled
from megaulysses.config.rules_memory import fpdt_chunks
from megaulysses.model.gpt import count_parameters, parameter_count
from megaulysses.parallel.comm import BYTE_KINDS
from megaulysses.parallel.dims import CP, DP_SP, PP
from megaulysses.planner.memory import format_plan, plan_memory
from megaulysses.training.checkpoint import TrainState
from megaulysses.training.metrics import format_duration, memory_stats
from megaulysses.training.optim import LossScaler
from megaulysses.training.run import Run

log = logging.getLogger(__name__)

COMM_KEYS = {"all_to_all": "a2a"}  # metric names of the collectives' kinds, where shorter
ZERO_SHARDS = {0: "nothing sharded", 1: "optimizer states sharded",
               2: "optimizer states and gradients sharded",
               3: "optimizer states, gradients and parameters sharded"}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


class Window:
    """Sums over the iterations between two log lines."""

    def __init__(self) -> None:
        self.steps = self.skipped = self.tokens = 0
        self.loss = self.grad_norm = self.time = 0.0
        self.last: Any = None  # the last step's result

    def add(self, r: Any, seconds: float, tokens: int) -> None:
        """`r`: a step.StepResult."""
        self.last = r
        self.steps += 1
        self.skipped += int(r.skipped)
        self.tokens += tokens  # every token processed, loss-masked or not (as Megatron)
        self.loss += r.loss
        self.grad_norm += 0.0 if r.skipped else r.grad_norm
        self.time += seconds


def _positions(m) -> str:
    """"rope (base 500000, llama3 x8 from 8192)": the positions and their scaling."""
    if m.position_embedding_type != "rope":
        return m.position_embedding_type
    scaling = {"llama3": lambda: f", llama3 x{m.rope_scaling_factor:g} from "
                                 f"{m.original_max_positions}",
               "linear": lambda: f", linear x{m.rotary_seq_len_interpolation_factor:g}",
               "yarn": lambda: f", yarn x{m.rotary_scaling_factor:g} from "
                               f"{m.original_max_positions}"}.get(m.rope_scaling, str)()
    return f"rope (base {m.rotary_base:g}{scaling})"


def log_startup(run: Run) -> None:
    """The model, the grid, ZeRO, recomputation, the memory plan and the pipeline."""
    m, d = run.cfg.model, run.cfg.dims
    style = (f"{_positions(m)}, {m.normalization}, "
             f"{'SwiGLU' if m.swiglu else 'GeLU'}, {'bias' if m.add_bias_linear else 'no bias'}"
             f"{', q/k/v bias' if m.add_qkv_bias and not m.add_bias_linear else ''}"
             f"{', q/k norm' if m.qk_layernorm else ''}, "
             f"{'untied' if m.untie_embeddings_and_output_weights else 'tied'} embeddings")
    log.info("model: %d layers, hidden %d, ffn %d, %d heads / %d kv heads, seq %d, "
             "vocab %d (padded %d); %s; %.2fM parameters; attention %s; %s on %s, "
             "residual stream %s", m.num_layers, m.hidden_size, m.ffn_size,
             m.num_attention_heads, m.num_kv_heads, m.seq_length, m.vocab_size,
             m.padded_vocab_size, style, parameter_count(m) / 1e6, run.backend, run.dtype,
             run.device, "fp32" if m.fp32_residual_connection or run.dtype == torch.float32
             else f"{run.dtype} (--fp32-residual-connection: fp32)")
    log.info("grid: world %d = dp %d x tp %d x pp %d x sp %d (Ulysses) x cp %d (ring)%s",
             d.world, d.dp, d.tp, d.pp, d.sp, d.cp, "; Megatron sequence parallel in tp" if
             run.cfg.parallel.tp_sequence_parallel else "")
    _log_zero(run)
    _log_memory(run)
    parts = run.parts
    if parts.pipeline is not None:
        layout = run.cfg.layout
        log.info("pipeline: %s schedule, %d micro-batches per step, %d stages (%d per "
                 "rank), layers per stage %s; the first stage holds %.2fM parameters",
                 run.cfg.parallel.pipeline_schedule, parts.pipeline.n_micro, len(layout),
                 len(layout) // d.pp, [len(s) for s in layout],
                 count_parameters(parts.model) / 1e6)


def _log_zero(run: Run) -> None:
    asked, n, stage = run.cfg.parallel.zero_stage, run.comm.size(DP_SP), run.parts.zero_stage
    held = run.parts.zero.held_bytes()
    if run.parts.zero.own is not None:
        log.info("zero: the distributed optimizer over dp x sp = %d ranks; model states held "
                 "now: parameters %s, gradient buffer %s, main weights %s; Adam's moments "
                 "appear at the first step", n, _mib(held["params"]), _mib(held["grads"]),
                 _mib(held["optim"]))
        return
    if asked and not stage:
        log.info("zero: --zero-stage %d has nothing to shard over (dp x sp = 1): stage 0",
                 asked)
    log.info("zero: stage %d over dp x sp = %d ranks (%s); model states held now: "
             "parameters %s; gradients and optimizer states appear at the first step "
             "and are logged every --log-interval", stage, n, ZERO_SHARDS[stage],
             _mib(held["params"]))


def _log_memory(run: Run) -> None:
    mem = run.cfg.memory
    recompute = {None: "off", "selective": "selective (the attention core)",
                 "full": f"full ({mem.recompute_method}, {mem.recompute_num_layers} "
                         f"layer{'s' if mem.recompute_num_layers != 1 else ''})"}
    offload = (f"the inputs kept for the first {mem.cpu_offloading_num_layers} layers of "
               "each stage offloaded to host" if mem.cpu_offloading_num_layers else
               "no activation offload")
    heads = (f"attention by {mem.attention_head_groups} groups of heads"
             if mem.attention_head_groups > 1 else "attention heads in one group")
    chunks = fpdt_chunks(run.cfg.model, mem)
    if chunks:
        heads += (f"; Ulysses attention in {chunks} sequence chunks (FPDT, block kernel"
                  f"{', kept on the host' if mem.ds_sequence_parallel_fpdt_offloading else ''})")
    log.info("memory: recomputation %s; MLP %s; %s; %s", recompute[mem.recompute_granularity],
             f"tiled in {mem.tiled_mlp_chunks} chunks" if mem.tiled_mlp_chunks > 1
             else "not tiled", offload, heads)
    log.info("%s", format_plan(plan_memory(run.cfg, run.cfg.dims, run.comm.rank(PP),
                                           run.device.type, cp_rank=run.comm.rank(CP))))


def iteration_record(run: Run, state: TrainState, w: Window, flops: float, peak: float,
                     start_iter: int, t_start: float, scaler: Any, step: dict) -> dict:
    """The metrics of the last `w.steps` iterations (and the log line saying them). `step`:
    the last step's global batch size and learning rate(s) (LRSchedule.logged)."""
    it, parts = state.iteration, run.parts
    iters = filled(run.cfg.train.train_iters, "--train-iters")
    step_time = w.time / w.steps
    tflops = flops / step_time / run.cfg.dims.world / 1e12  # per device, as Megatron
    eta = (time.perf_counter() - t_start) / (it - start_iter) * (iters - it)
    rec = {"iteration": it, "consumed_samples": state.consumed_train_samples, **step,
           "loss": w.loss / w.steps,
           "grad_norm": w.grad_norm / max(1, w.steps - w.skipped),
           "step_time_s": step_time, "tokens_per_sec": w.tokens / w.time,
           "tflops_per_device": tflops, "mfu": tflops / peak,
           "skipped_iterations": state.skipped_iterations, **memory_stats(run.device)}
    for kind, nbytes in parts.zero.pop_peak().items():  # model states held by this rank
        rec[f"mem_{kind}_bytes"] = nbytes
    for kind, nbytes in run.comm.pop_busiest_bytes().items():  # per iteration
        rec[f"comm_bytes_{COMM_KEYS.get(kind, kind)}"] = nbytes / w.steps
    if isinstance(scaler, LossScaler):
        rec["loss_scale"] = scaler.scale
    rec.update(_norms(w.last))  # the last step's, as Megatron-LM logs them
    _log_line(rec, iters, format_duration(eta))
    return rec


def _norms(r: Any) -> dict:
    """--log-params-norm's and --log-num-zeros-in-grad's values of step result `r`."""
    out = {"params_norm": r.params_norm, "num_zeros": r.num_zeros}
    return {k: v for k, v in out.items() if v is not None}


def _log_line(rec: dict, train_iters: int, eta: str) -> None:
    comm = " | ".join(f"{k[len('comm_bytes_'):]} {v / 2**20:.1f} MiB/it"
                      for k, v in rec.items() if k.startswith("comm_bytes_"))
    decoupled = f" | decoupled lr {rec['decoupled_lr']:.3e}" if "decoupled_lr" in rec else ""
    host = (f" (host {rec['mem_host_bytes'] / 2**20:.1f} MiB)" if "mem_host_bytes" in rec
            else "")  # --optimizer-cpu-offload's
    norms = (f" | num zeros {rec['num_zeros']}" if "num_zeros" in rec else "") + (
        f" | params norm {rec['params_norm']:.3f}" if "params_norm" in rec else "")
    log.info("iteration %6d/%6d | samples %9d | global batch %5d | loss %.4f | lr %.3e%s | "
             "grad norm %.3f%s | %.0f ms/it | %.0f tokens/s | %.2f TFLOP/s/device | MFU %.1f%% | "
             "skipped %d | mem peak %.2f GiB | states p/g/o %.1f/%.1f/%.1f MiB%s%s | ETA %s",
             rec["iteration"], train_iters, rec["consumed_samples"], rec["global_batch_size"],
             rec["loss"], rec["lr"], decoupled, rec["grad_norm"], norms,
             1e3 * rec["step_time_s"],
             rec["tokens_per_sec"], rec["tflops_per_device"], 100 * rec["mfu"],
             rec["skipped_iterations"], rec["mem_peak_gib"],
             *(rec.get(f"mem_{k}_bytes", 0) / 2**20 for k in ("params", "grads", "optim")),
             host, f" | {comm}" if comm else "", eta)


# --log-timers-to-tensorboard's timers: the step's phases (always written) and the
# collectives' kinds (written where some rank spent time in them)
PHASES = ("forward", "backward", "optimizer")
TIMER_NAMES = PHASES + BYTE_KINDS


class IterationScalars:
    """Each --tensorboard-log-interval-th iteration's scalars for tensorboard and wandb,
    as Megatron-LM writes them: that iteration's loss, learning rate, batch size, gradient
    norm, step time (and parameter norm, zero count, loss scale), and with
    --log-timers-to-tensorboard the timers as time_<name>_s: seconds per iteration since
    the previous write, of the rank that spent the most. Every rank calls `after_step`
    (the timers' maximum is a collective); rank 0's MetricsWriter writes the record.
    Building it turns the timers on, where there is a tensorboard or wandb to write to."""

    def __init__(self, run: Run):
        lg = run.cfg.log
        self.run, self.interval = run, lg.tensorboard_log_interval
        self.on = bool(lg.tensorboard_dir or lg.wandb_project)
        self.timed = self.on and lg.log_timers_to_tensorboard
        run.comm.stats.timers.on = self.timed
        if lg.log_timers_to_tensorboard and not self.on:
            log.warning("--log-timers-to-tensorboard without --tensorboard-dir or "
                        "--wandb-project: nothing to write the timers to, nothing is timed")
        self.steps = 0  # since the last write

    def after_step(self, state: TrainState, r: Any, seconds: float, step: dict,
                   scaler: Any) -> Optional[dict]:
        """The record of the iteration `state` has just finished, when it is one to
        write, else None. `r`: its step.StepResult; `step`: its global batch size and
        learning rate(s), as iteration_record takes them."""
        self.steps += 1
        if not self.on or state.iteration % self.interval:
            return None
        rec = {"iteration": state.iteration, **step, "loss": r.loss, "step_time_s": seconds,
               **({} if r.skipped else {"grad_norm": r.grad_norm}), **_norms(r)}
        if isinstance(scaler, LossScaler):
            rec["loss_scale"] = scaler.scale
        if self.timed:
            spent = self.run.comm.pop_slowest_seconds(TIMER_NAMES)
            rec.update({_timer_tag(name): s / self.steps for name, s in spent.items()
                        if s or name in PHASES})
        self.steps = 0
        return rec


def _timer_tag(name: str) -> str:
    """time_forward_s, ...; a collective kind's time_comm_<kind>_s (as in comm_bytes_*)."""
    return f"time_{name}_s" if name in PHASES else f"time_comm_{COMM_KEYS.get(name, name)}_s"
