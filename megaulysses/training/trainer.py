"""The training loop: micro-batches, exact loss reduction, clip, step, eval, checkpoints.

Loss contract (the same on every grid): the loss of an iteration is
sum(token losses * loss mask) / sum(loss mask) over the whole global batch. The token
count is known before any forward (it only needs the masks), so each micro-batch's
backward uses the final denominator and the accumulated gradient is exactly the gradient
of the global mean loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import numpy as np
import torch

from megaulysses.config import Config, ConfigError, TrainingError, pipeline_layout
from megaulysses.data.build import build_datasets, load_tokenizer
from megaulysses.data.loader import BatchBuilder
from megaulysses.model.attention import mask_from_config, select_backend
from megaulysses.model.generate import sample
from megaulysses.model.gpt import GPT, build_model, count_parameters, parameter_count
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import CP, DP, DP_SP, PP, SP, ParallelDims, init_distributed
from megaulysses.parallel.grad_norm import unscale_and_clip
from megaulysses.parallel.memory_plan import format_plan, plan_memory
from megaulysses.parallel.parallelize import parallelize
from megaulysses.parallel.pipeline import Pipeline, full_state_dict
from megaulysses.parallel.ring import local_positions
from megaulysses.parallel.tensor import step_context as tp_step_context
from megaulysses.parallel.zero import Zero
from megaulysses.training import checkpoint as ckpt
from megaulysses.training import determinism
from megaulysses.training import faults
from megaulysses.training.device import pick_device
from megaulysses.training import precision
from megaulysses.training.outputs import check_outputs
from megaulysses.training.metrics import (MetricsWriter, flops_per_iteration, format_duration,
                                          memory_stats, peak_tflops)
from megaulysses.training.optim import LossScaler, LRSchedule, adamw, param_groups, set_lr
from megaulysses.training.stop import StopConditions, mark_saved_on_stop

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    tokens: int
    nonfinite: bool = False  # the loss or gradient norm was not finite on some rank


def compute_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else torch.float32


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _on(b: dict, device) -> dict:
    """A micro-batch (tokens, position_ids, labels, loss_mask) moved to `device`."""
    return {k: v.to(device) for k, v in b.items()}


def global_sum(comm: Comm, value: float, device, dims=(DP_SP,)) -> float:
    """Sum of a per-rank number over the ranks that see different tokens (dp x sp), and
    over PP for numbers only the last pipeline stage knows (losses)."""
    t = torch.tensor(value, dtype=torch.float64, device=device)
    for dim in dims:
        comm.all_reduce_sum(t, dim)
    return float(t)


def train_step(model, batches, zero: Zero, scaler: LossScaler, clip_grad: float, device,
               dtype, comm: Comm, pipeline: Optional[Pipeline] = None,
               check_nan: bool = True, fault=None) -> StepResult:
    """One iteration. `check_nan`: a non-finite loss or gradient norm on any rank skips
    the step on every rank. `fault`: a test's injection, run on the gradients mid-step."""
    with tp_step_context(comm):
        # The global loss-token count is known before any forward: every backward divides
        # by it, so the summed gradients are exactly those of the global mean loss.
        tokens = global_sum(comm, sum(float(b["loss_mask"].sum()) for b in batches), device)
        denom = max(tokens, 1.0)  # a batch with no loss tokens gives loss 0, not NaN
        if pipeline is None:
            loss_sum = _forward_backward(model, batches, scaler.scale / denom, device, dtype,
                                         zero)
        else:
            with autocast(device, dtype):
                loss_sum = pipeline.step([_on(b, device) for b in batches], scaler.scale / denom)
        norm, skipped, nonfinite = _finish_grads_and_step(
            zero, scaler, clip_grad, comm, pipeline, math.isfinite(loss_sum), check_nan, fault)
    loss = global_sum(comm, loss_sum, device, (DP_SP, PP)) / denom
    return StepResult(loss, norm, skipped, int(tokens), nonfinite)


def _forward_backward(model, batches, grad_scale: float, device, dtype, zero: Zero) -> float:
    """Every micro-batch, one after the other; gradients of sum(losses) * grad_scale."""
    loss_sum = torch.zeros((), device=device)
    for i, b in enumerate(batches):
        b = _on(b, device)
        with autocast(device, dtype):
            losses = model(b["tokens"], b["position_ids"], b["labels"],
                           b.get("documents"))  # [b, s/sp] fp32
        micro_sum = (losses * b["loss_mask"]).sum()
        zero.before_backward(last=i == len(batches) - 1)  # the last one reduces as it runs
        (micro_sum * grad_scale).backward()
        loss_sum += micro_sum.detach()
    return float(loss_sum)


def _finish_grads_and_step(zero: Zero, scaler, clip_grad, comm, pipeline, loss_finite: bool,
                           check_nan: bool, fault=None) -> tuple[float, bool, bool]:
    """Reduce gradients over dp x sp (and the tied pair), clip by the global norm and
    step, unless a loss or the norm is not finite on any rank: (norm, skipped, non-finite).
    Every rank decides alike (one tiny all-reduce): a NaN that only one rank sees must not
    step the others alone."""
    zero.finish_grads()
    if fault is not None:
        fault([p.tensor for p in zero.grad_parts()])
    if pipeline is not None:
        pipeline.sync_tied_grads(zero.grad_of)  # after the reduction: both copies alike
    excluded = pipeline.norm_excluded if pipeline is not None else []
    norm = unscale_and_clip(zero.grad_parts(excluded), 1.0 / scaler.scale, clip_grad, comm)
    nonfinite = comm.any_rank(not (loss_finite and math.isfinite(norm)))
    # fp16 skips an overflow whatever --check-for-nan-in-loss-and-grad says: its loss
    # scale must fall
    skipped = nonfinite and (check_nan or isinstance(scaler, LossScaler))
    if not skipped:
        zero.step()
    scaler.update(overflow=nonfinite)
    zero.zero_grad()
    return norm, skipped, nonfinite


@torch.no_grad()
def evaluate(model, builder: BatchBuilder, first_sample: int, iters: int, device, dtype,
             comm: Comm, pipeline: Optional[Pipeline] = None) -> float:
    """Token-weighted mean loss over `iters` global batches starting at `first_sample`.
    Its collectives are not counted: the logged bytes are those of training steps."""
    with tp_step_context(comm), comm.stats.paused():
        model.eval()
        total, count = 0.0, 0.0
        for i in range(iters):
            start = first_sample + i * builder.gbs
            batches = [_on(b, device) for b in builder.micro_batches(start)]
            with autocast(device, dtype):
                total += (pipeline.evaluate(batches) if pipeline is not None
                          else sum(_eval_micro(model, b) for b in batches))
            count += sum(float(b["loss_mask"].sum()) for b in batches)
        model.train()
        total = global_sum(comm, total, device, (DP_SP, PP))
        return total / max(global_sum(comm, count, device), 1.0)


def _eval_micro(model, b: dict) -> float:
    losses = model(b["tokens"], b["position_ids"], b["labels"], b.get("documents"))  # [b, s/sp]
    return float((losses * b["loss_mask"]).sum())


def seed_everything(seed: int):
    """Dropout and sampling draw from these; initial weights have their own generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        t = cfg.train
        self.started = time.monotonic()  # --exit-duration-in-mins counts from here
        seed_everything(t.seed)
        self.device = pick_device()
        # before the process group and the first matmul: NCCL and cuBLAS read it then
        log.info("%s", determinism.configure(t.deterministic, self.device))
        log.info("%s", precision.configure_tf32(self.device))  # before peak_tflops reads it
        self.dtype = compute_dtype(cfg)
        check_outputs(cfg)  # before anything is built: refusing is quick
        self.fault = faults.from_env()  # tests only
        self.timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
        self.rank, world = init_distributed(self.device, self.timeout)
        self.dims = ParallelDims.from_config(cfg, world)
        self.tokenizer = load_tokenizer(cfg)
        cfg.model.vocab_size = self.tokenizer.vocab_size
        self.dims.validate_config(cfg)
        name, core = attention_backend(cfg, self.dims, self.device, self.dtype)
        self.comm = Comm(self.dims.build_mesh(self.device.type, self.timeout)
                         if world > 1 else None)
        self._build_data()
        with torch.device("meta"):
            model = GPT(cfg.model, core)
        built = parallelize(model, self.dims, self.comm, cfg, self.device, self.dtype,
                            lambda m: param_groups(m, t.weight_decay),
                            lambda groups: adamw(groups, t))
        self.model, self.pipeline, self.zero = built.model, built.pipeline, built.zero
        self.zero_stage, self.layout = built.zero_stage, built.layout
        self.sequence_parallel = built.sequence_parallel
        self.optimizer = self.zero.optimizer
        self.schedule = LRSchedule(t)
        self.scaler = LossScaler(t) if t.fp16 else _NoScaler()
        self.state = ckpt.TrainState()
        self.consecutive_skipped = 0
        self.saver = self._build_saver() if t.save else None
        self._log_model(name)
        if t.load:
            self._load(t.load)

    def _build_data(self):
        """Rank 0 builds (and caches) the sample indices first; the others then load them."""
        cfg, t = self.cfg, self.cfg.train
        if self.rank == 0:
            try:
                splits = build_datasets(cfg, self.tokenizer.vocab_size)
            finally:  # an error here is raised on every rank below: nobody waits forever
                self.comm.barrier()
        else:
            self.comm.barrier()
            splits = build_datasets(cfg, self.tokenizer.vocab_size)
        d = self.dims
        positions = None if d.seq_degree == 1 else local_positions(
            cfg.model.seq_length, d.cp, self.comm.rank(CP), d.sp, self.comm.rank(SP))
        make = lambda ds: ds and BatchBuilder(
            ds, t.micro_batch_size, t.global_batch_size, dp_rank=self.comm.rank(DP),
            dp_size=d.dp, positions=positions, eod=self.tokenizer.eod,
            eod_mask_loss=cfg.data.eod_mask_loss, reset_position_ids=cfg.data.reset_position_ids,
            reset_attention_mask=cfg.data.reset_attention_mask)
        self.train_data, self.valid_data, self.test_data = (make(ds) for ds in splits)

    def _log_model(self, backend: str):
        m = self.cfg.model
        style = (f"{m.position_embedding_type}, {m.normalization}, "
                 f"{'SwiGLU' if m.swiglu else 'GeLU'}, {'bias' if m.add_bias_linear else 'no bias'}, "
                 f"{'untied' if m.untie_embeddings_and_output_weights else 'tied'} embeddings")
        log.info("model: %d layers, hidden %d, ffn %d, %d heads / %d kv heads, seq %d, "
                 "vocab %d (padded %d); %s; %.2fM parameters; attention %s; %s on %s",
                 m.num_layers, m.hidden_size, m.ffn_size, m.num_attention_heads, m.num_kv_heads,
                 m.seq_length, m.vocab_size, m.padded_vocab_size, style,
                 parameter_count(m) / 1e6, backend, self.dtype, self.device)
        d = self.dims
        log.info("grid: world %d = dp %d x tp %d x pp %d x sp %d (Ulysses) x cp %d (ring)%s",
                 d.world, d.dp, d.tp, d.pp, d.sp, d.cp, "; Megatron sequence parallel in tp" if
                 self.sequence_parallel else "")
        self._log_zero()
        mem = self.cfg.memory
        recompute = {None: "off", "selective": "selective (the attention core)",
                     "full": f"full ({mem.recompute_method}, {mem.recompute_num_layers} "
                             f"layer{'s' if mem.recompute_num_layers != 1 else ''})"}
        log.info("memory: recomputation %s; MLP %s", recompute[mem.recompute_granularity],
                 f"tiled in {mem.tiled_mlp_chunks} chunks" if mem.tiled_mlp_chunks > 1
                 else "not tiled")
        log.info("%s", format_plan(plan_memory(self.cfg, d, self.comm.rank(PP),
                                               self.device.type, cp_rank=self.comm.rank(CP))))
        if self.pipeline is not None:
            log.info("pipeline: %s schedule, %d micro-batches per step, %d stages (%d per "
                     "rank), layers per stage %s; the first stage holds %.2fM parameters",
                     self.cfg.parallel.pipeline_schedule, self.pipeline.n_micro,
                     len(self.layout), len(self.layout) // d.pp, [len(s) for s in self.layout],
                     count_parameters(self.model) / 1e6)

    def _log_zero(self):
        asked, n = self.cfg.parallel.zero_stage, self.comm.size(DP_SP)
        if asked and not self.zero_stage:
            log.info("zero: --zero-stage %d has nothing to shard over (dp x sp = 1): stage 0",
                     asked)
        held = self.zero.held_bytes()
        log.info("zero: stage %d over dp x sp = %d ranks (%s); model states held now: "
                 "parameters %s; gradients and optimizer states appear at the first step "
                 "and are logged every --log-interval", self.zero_stage, n,
                 ZERO_SHARDS[self.zero_stage], _mib(held["params"]))

    # -- checkpoints ------------------------------------------------------------------------

    def _build_saver(self) -> ckpt.Saver:
        t = self.cfg.train
        group = self.comm.new_checkpoint_group(self.timeout) if t.async_save else None
        return ckpt.Saver(t.save, self.rank, self.comm.barrier, t.keep_last, t.async_save,
                          group)

    def _tokenizer_meta(self) -> dict:
        """What identifies the vocabulary: a checkpoint must be loaded with the same."""
        d = self.cfg.data
        if d.tokenizer_type == "NullTokenizer":
            return {"type": d.tokenizer_type, "vocab_size": self.tokenizer.vocab_size,
                    "flag": f"--vocab-size {d.vocab_size} (NullTokenizer)"}
        if not hasattr(self, "_tokenizer_sha"):
            self._tokenizer_sha = ckpt.file_sha256(d.tokenizer_model)
        return {"type": d.tokenizer_type, "vocab_size": self.tokenizer.vocab_size,
                "sha256": self._tokenizer_sha, "flag": f"--tokenizer-model {d.tokenizer_model}"}

    def _checkpoint_meta(self) -> dict:
        cfg, t, d = self.cfg, self.cfg.train, self.dims
        return {"model": cfg.model.shape_dict(), "tokenizer": self._tokenizer_meta(),
                "lr_schedule": _schedule_meta(t), "data": _data_meta(cfg),
                "grid": {"dp": d.dp, "tp": d.tp, "pp": d.pp, "sp": d.sp,
                         "zero_stage": self.zero_stage},
                "args": dataclasses.asdict(cfg)}

    def _load(self, load_dir: str):
        t = self.cfg.train
        path = ckpt.find_checkpoint(load_dir, t.save)
        if path is None:
            return
        expect = {"model": self.cfg.model.shape_dict(), "tokenizer": self._tokenizer_meta()}
        self.state, meta = ckpt.load_checkpoint(path, self.model, self.optimizer, expect,
                                                self.rank, load_optim=not t.no_load_optim,
                                                load_rng=not t.no_load_rng)
        if self.state.loss_scaler and isinstance(self.scaler, LossScaler):
            self.scaler.load_state_dict(self.state.loss_scaler)
        _warn_changed(path, "lr_schedule", meta, _schedule_meta(t),
                      "the new value applies from here on")
        _warn_changed(path, "data", meta, _data_meta(self.cfg),
                      "the samples from here on differ from the saved run's")
        if self.state.iteration >= t.train_iters:
            log.warning("%s is at iteration %d, not before --train-iters %d: nothing to train",
                        path, self.state.iteration, t.train_iters)

    def save(self):
        self.state.loss_scaler = self.scaler.state_dict()
        tokenizer = self.cfg.data.tokenizer_model if self.cfg.data.tokenizer_type != \
            "NullTokenizer" else None
        self.saver.save(self.model, self.optimizer, self.state, self._checkpoint_meta(),
                        tokenizer)

    def train(self) -> dict:
        """Train to --train-iters, or until --exit-interval, a signal or
        --exit-duration-in-mins stops every rank after the same step (then it saves)."""
        cfg, t = self.cfg, self.cfg.train
        writer = MetricsWriter(cfg.log.tensorboard_dir, cfg.log.metrics_jsonl,
                               resumed_at=self.state.iteration or None, enabled=self.rank == 0)
        stop = StopConditions(t.exit_signal_handler, t.exit_duration_in_mins, self.started)
        resumed = self.state.iteration
        try:
            last_eval, stopped = self._loop(writer, stop)
            it = self.state.iteration
            if t.save and it > resumed and self.saver.last_saved != it:
                self.save()
            if t.save:
                self.saver.wait()  # a background save is committed before we go on
                if stopped:
                    mark_saved_on_stop(self.rank, it)
        except TrainingError:
            if t.save:  # every rank stops at the same step: a save in flight completes
                self.saver.wait()
            writer.close()
            raise
        finally:
            stop.close()
        trained = self.state.iteration > resumed  # a finished run resumed: tested already
        if t.eval_iters and self.test_data and not stopped and trained:
            self._eval(writer, "test", self.test_data, 0)
        writer.close()
        return {"iteration": self.state.iteration, "eval_loss": last_eval, "stopped": stopped}

    def _loop(self, writer: MetricsWriter, stop: StopConditions):
        cfg, t = self.cfg, self.cfg.train
        flops = flops_per_iteration(cfg.model, t.global_batch_size)
        peak = peak_tflops(self.device, self.dtype, cfg.log.peak_tflops)
        log.info("peak %.1f TFLOP/s per device for MFU; %.2f TFLOP per iteration",
                 peak, flops / 1e12)
        window = _Window()
        start_iter, t_start = self.state.iteration, time.perf_counter()
        last_eval = None
        while self.state.iteration < t.train_iters:
            if self.saver is not None:
                self.saver.poll()  # commit a finished background save
            set_lr(self.optimizer, self.schedule(self.state.iteration))
            t0 = time.perf_counter()
            batches = self.train_data.micro_batches(self.state.consumed_train_samples)
            fault = self.fault and self.fault.hook(self.rank, self.state.iteration + 1)
            r = train_step(self.model, batches, self.zero, self.scaler, t.clip_grad,
                           self.device, self.dtype, self.comm, self.pipeline,
                           t.check_for_nan_in_loss_and_grad, fault)
            window.add(r, time.perf_counter() - t0, t.global_batch_size * cfg.model.seq_length)
            self.state.iteration += 1
            self.state.consumed_train_samples += t.global_batch_size
            self.state.skipped_iterations += int(r.skipped)
            it = self.state.iteration
            if it % cfg.log.log_interval == 0 or it == t.train_iters:
                rec = self._log(window, flops, peak, start_iter, t_start)
                writer.write(rec)
                window = _Window()
            self._count_skips(r, it)  # after the log: the stopping iteration is logged
            if t.eval_iters and self.valid_data and (it % t.eval_interval == 0
                                                     or it == t.train_iters):
                last_eval = self._eval(writer, "valid", self.valid_data,
                                       (it // t.eval_interval) * t.eval_iters * t.global_batch_size)
            if t.save and t.save_interval and it % t.save_interval == 0:
                self.save()
            reason = stop.reason(self.comm)
            if reason is not None:
                log.info("%s: stopping after iteration %d%s", reason, it,
                         " (saving a checkpoint)" if t.save else " (no --save: nothing saved)")
                return last_eval, reason
            if t.exit_interval and it % t.exit_interval == 0 and it < t.train_iters:
                log.info("--exit-interval %d: stopping after iteration %d", t.exit_interval, it)
                break
        return last_eval, None

    def _count_skips(self, r: StepResult, it: int):
        """Log a step skipped for a non-finite loss or gradient norm; stop the run after
        --max-consecutive-skipped of them in a row (fp16: only those the loss scale can no
        longer absorb count)."""
        t = self.cfg.train
        if r.nonfinite and self.rank == 0 and not (r.skipped and
                                                   isinstance(self.scaler, LossScaler)):
            log.warning("iteration %d: a non-finite loss or gradient norm on some rank: %s",
                        it, "step skipped on every rank" if r.skipped else
                        "step taken (--no-check-for-nan-in-loss-and-grad)")
        counts = r.skipped and not (isinstance(self.scaler, LossScaler) and self.scaler.dynamic
                                    and self.scaler.scale > self.scaler.min_scale)
        self.consecutive_skipped = self.consecutive_skipped + 1 if counts else 0
        limit = t.max_consecutive_skipped
        if limit and self.consecutive_skipped >= limit:
            raise TrainingError(
                f"iteration {it}: {limit} steps in a row skipped for a non-finite loss or "
                f"gradient norm (--max-consecutive-skipped {limit}); stopped without saving"
                + (f" (the checkpoints in {t.save} are as they were)" if t.save else ""))

    def _eval(self, writer, split: str, data: BatchBuilder, first: int) -> float:
        loss = evaluate(self.model, data, first, self.cfg.train.eval_iters, self.device,
                        self.dtype, self.comm, self.pipeline)
        self.zero.reshard()  # ZeRO-2/3: parameters evaluation gathered are freed again
        log.info("%s loss at iteration %d: %.4f | ppl %.2f", split, self.state.iteration, loss,
                 math.exp(min(loss, 50.0)))
        key = "eval_loss" if split == "valid" else "test_loss"
        writer.write({"iteration": self.state.iteration, key: loss})
        return loss

    def _log(self, w: "_Window", flops: float, peak: float, start_iter: int,
             t_start: float) -> dict:
        t, it = self.cfg.train, self.state.iteration
        step_time = w.time / w.steps
        tokens_per_sec = w.tokens / w.time
        tflops = flops / step_time / self.dims.world / 1e12  # per device, as Megatron
        done = it - start_iter
        eta = (time.perf_counter() - t_start) / done * (t.train_iters - it)
        rec = {"iteration": it, "consumed_samples": self.state.consumed_train_samples,
               "loss": w.loss / w.steps, "lr": self.optimizer.param_groups[0]["lr"],
               "grad_norm": w.grad_norm / max(1, w.steps - w.skipped),
               "step_time_s": step_time, "tokens_per_sec": tokens_per_sec,
               "tflops_per_device": tflops, "mfu": tflops / peak,
               "skipped_iterations": self.state.skipped_iterations,
               **memory_stats(self.device)}
        for kind, nbytes in self.zero.pop_peak().items():  # model states held by this rank
            rec[f"mem_{kind}_bytes"] = nbytes
        for kind, nbytes in self.comm.pop_busiest_bytes().items():  # per iteration
            rec[f"comm_bytes_{COMM_KEYS.get(kind, kind)}"] = nbytes / w.steps
        if isinstance(self.scaler, LossScaler):
            rec["loss_scale"] = self.scaler.scale
        comm = " | ".join(f"{k[len('comm_bytes_'):]} {v / 2**20:.1f} MiB/it"
                          for k, v in rec.items() if k.startswith("comm_bytes_"))
        log.info("iteration %6d/%6d | samples %9d | loss %.4f | lr %.3e | grad norm %.3f | "
                 "%.0f ms/it | %.0f tokens/s | %.2f TFLOP/s/device | MFU %.1f%% | skipped %d | "
                 "mem peak %.2f GiB | states p/g/o %.1f/%.1f/%.1f MiB%s | ETA %s", it,
                 t.train_iters, rec["consumed_samples"], rec["loss"], rec["lr"],
                 rec["grad_norm"], 1e3 * step_time, tokens_per_sec, tflops, 100 * rec["mfu"],
                 rec["skipped_iterations"], rec["mem_peak_gib"],
                 *(rec.get(f"mem_{k}_bytes", 0) / 2**20 for k in ("params", "grads", "optim")),
                 f" | {comm}" if comm else "", format_duration(eta))
        return rec

    def generate(self):
        """Rank 0 samples from the trained model in the compute dtype (autocast), through an
        attention core chosen for the device and dtype it runs in. One process samples from
        its own model; on a grid the shards and stages are gathered (every rank takes part)
        into a whole model on rank 0's CPU: no second whole model on the accelerator beside
        the training state."""
        t = self.cfg.train
        if not t.generate:
            return None
        model, device = self.model, self.device
        if self.dims.world > 1:
            state = full_state_dict(self.model, self.comm)
            if self.rank != 0:
                return None
            device = torch.device("cpu")
            core = select_backend("auto", device, self.dtype,
                                  mask_from_config(self.cfg.model))[1]
            model = build_model(self.cfg.model, core, t.seed, device)
            model.load_state_dict(state)
        prompt = self.tokenizer.tokenize(t.generate_prompt) if t.generate_prompt else []
        prompt = prompt or [self.tokenizer.eod]  # start of a new document
        with autocast(device, self.dtype):
            new = sample(model, prompt, t.generate, self.cfg.model.seq_length,
                         self.tokenizer.vocab_size, t.generate_temperature, t.generate_top_k,
                         seed=t.seed)
        return self.tokenizer.detokenize([i for i in new if i != self.tokenizer.eod])


def attention_backend(cfg: Config, dims: ParallelDims, device: torch.device,
                      dtype: torch.dtype) -> tuple[str, object]:
    """--attention-backend for the model's mask; ConfigError where it cannot run it. Under
    ring attention (cp > 1) the ring runs its own kernels whatever is chosen: a fused one
    for plain causal or full steps (model/attention/fused.py), the block kernel for masks."""
    m = cfg.model
    if dims.cp > 1 and m.attention_backend not in ("auto", "block"):
        raise ConfigError("--attention-backend", f"{m.attention_backend}: ring attention "
                          "(--context-parallel-size > 1) runs its own kernels; use auto "
                          "or block")
    try:
        name, core = select_backend(m.attention_backend, device, dtype, mask_from_config(m),
                                    cfg.data.reset_attention_mask, m.attention_dropout)
    except ValueError as e:
        flag, rule = str(e).split(": ", 1)
        raise ConfigError(flag, rule) from None
    if dims.cp > 1:
        log.info("attention: ring over cp = %d: plain causal or full steps on a fused kernel, "
                 "masked steps on the block kernel", dims.cp)
        name = "ring"
    return name, core


COMM_KEYS = {"all_to_all": "a2a"}


def _schedule_meta(t) -> dict:
    return {"lr": t.lr, "min_lr": t.min_lr, "lr_decay_style": t.lr_decay_style,
            "lr_warmup_iters": t.lr_warmup_iters,
            "lr_decay_iters": t.lr_decay_iters or t.train_iters}


def _data_meta(cfg: Config) -> dict:
    d = cfg.data
    return {"data_path": list(d.data_path), "split": d.split, "seed": cfg.train.seed,
            "mock_data": d.mock_data, "seq_length": cfg.model.seq_length}


def _warn_changed(path: str, key: str, meta: dict, now: dict, consequence: str):
    """Flags that may change on resume (unlike the model's shape), but rarely should."""
    saved = meta.get(key, {})
    for name, value in now.items():
        if name in saved and saved[name] != value:
            log.warning("--%s is %s but %s was saved with %s: %s", name.replace("_", "-"),
                        value, path, saved[name], consequence)
ZERO_SHARDS = {0: "nothing sharded", 1: "optimizer states sharded",
               2: "optimizer states and gradients sharded",
               3: "optimizer states, gradients and parameters sharded"}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


class _NoScaler:
    scale = 1.0

    def update(self, overflow: bool):
        pass

    def state_dict(self):
        return {}


class _Window:
    """Sums over the iterations between two log lines."""

    def __init__(self):
        self.steps = self.skipped = self.tokens = 0
        self.loss = self.grad_norm = self.time = 0.0

    def add(self, r: StepResult, seconds: float, tokens: int):
        self.steps += 1
        self.skipped += int(r.skipped)
        self.tokens += tokens  # every token processed, loss-masked or not (as Megatron)
        self.loss += r.loss
        self.grad_norm += 0.0 if r.skipped else r.grad_norm
        self.time += seconds
