"""The training loop: iterations, evaluation, checkpoints, stopping. Everything it runs on
is built once by run.build_run; a step is step.train_step; what it says is report.py's."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Optional

from megaulysses.config import Config, RunConfig, TrainingError
from megaulysses.config.fields import filled
from megaulysses.config.schedule import global_batch_at
from megaulysses.data.loader import BatchBuilder
from megaulysses.training import checkpoint as ckpt
from megaulysses.training import faults, megatron
from megaulysses.training.load_rules import mask_of
from megaulysses.training.metrics import MetricsWriter, flops_per_iteration, peak_tflops
from megaulysses.training.optim import LossScaler, LRSchedule, lr_bounds, set_lr
from megaulysses.training.profiling import StepProfiler
from megaulysses.training.report import IterationScalars, Window, iteration_record, log_startup
from megaulysses.training.result_checks import ResultChecks, ResultRejected
from megaulysses.training.run import build_run
from megaulysses.training.sampling import generate_text
from megaulysses.training.saver import Saver
from megaulysses.training.storage import (Retention, checkpoint_bytes, free_bytes, mib,
                                          tokenizer_files)
from megaulysses.training.step import NoScaler, StepResult, evaluate, train_step
from megaulysses.training.stop import StopConditions, mark_saved_on_stop

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config):
        self.started = time.monotonic()  # --exit-duration-in-mins counts from here
        self.fault = faults.from_env()  # tests only
        self.run = build_run(cfg)
        self.profiler = StepProfiler(self.run.cfg, self.run.rank)  # --profile
        t = self.cfg.train
        self.schedule = LRSchedule(t, lr_bounds(self.model, t))
        self.batch: Optional[int] = None  # the last step's global batch (a ramp-up grows it)
        self.scaler = LossScaler(t) if t.fp16 else NoScaler()
        self.state = ckpt.TrainState()
        self.consecutive_skipped = 0
        # --check-for-spiky-loss, --check-for-large-grads, --check-for-nan-in-loss-and-grad
        # (--rerun-mode): a suspicious step runs again
        self.checks = ResultChecks(t.check_for_spiky_loss, t.check_for_large_grads, self.rank,
                                   nan=nan_mode(t, self.scaler))
        if t.check_for_nan_in_loss_and_grad and self.checks.nan == "off" and self.rank == 0:
            log.info("--check-for-nan-in-loss-and-grad off under --fp16 with dynamic loss "
                     "scaling, as in Megatron-LM: an overflow lowers the scale and skips the "
                     "step")
        self.converted_from: Optional[dict] = None  # set by _load from an imported model
        self.saver = self._build_saver(t.save) if t.save else None
        log_startup(self.run)
        if t.load:
            self._load(t.load)

    # The run's parts, by name (read-only: build_run made them).
    @property
    def cfg(self) -> RunConfig:
        return self.run.cfg

    dims = property(lambda self: self.run.cfg.dims)
    device = property(lambda self: self.run.device)
    dtype = property(lambda self: self.run.dtype)
    rank = property(lambda self: self.run.rank)
    comm = property(lambda self: self.run.comm)
    tokenizer = property(lambda self: self.run.tokenizer)
    model = property(lambda self: self.run.parts.model)
    pipeline = property(lambda self: self.run.parts.pipeline)
    zero = property(lambda self: self.run.parts.zero)
    optimizer = property(lambda self: self.run.parts.zero.optimizer)
    train_data = property(lambda self: self.run.data[0])
    valid_data = property(lambda self: self.run.data[1])
    test_data = property(lambda self: self.run.data[2])

    # -- checkpoints ------------------------------------------------------------------------

    def _build_saver(self, save_dir: str) -> Saver:
        t = self.cfg.train
        group = self.comm.new_checkpoint_group(self.run.timeout) if t.async_save else None
        size = checkpoint_bytes(self.cfg.model, tokenizer_files(self.cfg).values(),
                                self.dims.world, optim=not t.no_save_optim)
        retention = Retention(t.keep_last, t.save_retain_interval)
        log.info("checkpoints: %s each in %s (%s free)%s", mib(size), save_dir,
                 mib(free_bytes(save_dir)), f"; retention {retention.flags()}"
                 if retention.active else "; all kept (--keep-last, --save-retain-interval)")
        contents = ("model",) + (() if t.no_save_optim else ("optim",)) + (
            () if t.no_save_rng else ("rng",))
        return Saver(save_dir, self.rank, self.comm, retention, t.async_save, group, size,
                     self.fault, contents)

    def _load(self, load_dir: str) -> None:
        t, cfg = self.cfg.train, self.cfg
        path = ckpt.find_checkpoint(load_dir, t.save, t.exit_on_missing_checkpoint)
        if path is None:
            return
        expect = {"model": cfg.model.shape_dict(),
                  "tokenizer": ckpt.tokenizer_meta(cfg, self.tokenizer.vocab_size),
                  "mask": mask_of(cfg.model)}  # the attention mask it was trained with
        imported = megatron.is_megatron(path)
        if imported:  # converted by rank 0 into our format, read by all, then removed
            path = megatron.import_for_run(path, t.save, self.rank, self.comm)
        try:
            self.state, meta = ckpt.load_checkpoint(
                path, self.model, self.optimizer, expect, self.rank,
                load_optim=not t.no_load_optim, load_rng=not t.no_load_rng)
        finally:
            if imported:
                megatron.remove_import(path, self.rank, self.comm)
        # An imported model's origin (tools/convert_checkpoint.py: its family, source dtype,
        # special ids) goes on in every checkpoint trained from it, for the export back.
        self.converted_from = meta.get("converted_from")
        if self.saver is not None and os.path.dirname(os.path.abspath(path)) == \
                os.path.abspath(self.saver.save_dir):
            self.saver.protected = self.state.iteration  # retention keeps what we resumed
        if self.state.loss_scaler and isinstance(self.scaler, LossScaler):
            self.scaler.load_state_dict(self.state.loss_scaler)
        ckpt.warn_changed(path, "lr_schedule", meta, ckpt.schedule_meta(t),
                          "the new value applies from here on")
        ckpt.warn_changed(path, "data", meta, ckpt.data_meta(cfg),
                          "the samples from here on differ from the saved run's")
        iters = filled(t.train_iters, "--train-iters")
        if self.state.iteration >= iters:
            log.warning("%s is at iteration %d, not before --train-iters %d: nothing to train",
                        path, self.state.iteration, iters)

    def save(self) -> None:
        self.state.loss_scaler = self.scaler.state_dict()
        meta = ckpt.run_meta(self.cfg, self.tokenizer.vocab_size, self.run.parts.zero_stage)
        if self.converted_from:
            meta["converted_from"] = self.converted_from
        assert self.saver is not None, "saves are made only with --save"
        self.saver.save(self.model, self.optimizer, self.state, meta, tokenizer_files(self.cfg))

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        """Train to --train-iters, or until --exit-interval, a signal or
        --exit-duration-in-mins stops every rank after the same step (then it saves)."""
        cfg, t = self.cfg, self.cfg.train
        writer = MetricsWriter.for_run(cfg, self.rank, resumed_at=self.state.iteration or None)
        stop = StopConditions(filled(t.exit_signal_handler, "--exit-signal-handler"),
                              t.exit_duration_in_mins, self.started)
        resumed = self.state.iteration
        try:
            last_eval, stopped = self._loop(writer, stop)
            self.run.parts.zero.settle()  # an overlapped gather still in flight
            self._save_at_end(resumed, stopped)
        except TrainingError as e:
            if isinstance(e, ResultRejected) and e.checkpoint:
                self._save_for_rerun()
            if self.saver is not None:  # every rank stops at the same step: a save in
                self.saver.wait()  # flight completes
            writer.close()
            raise
        finally:
            stop.close()
            self.train_data.close()  # --num-workers: the loader's processes end here
            self.profiler.close()  # a trace a stopped run left open is written
        trained = self.state.iteration > resumed  # a finished run resumed: tested already
        if t.eval_iters and self.test_data and not stopped and trained:
            self._eval(writer, "test", self.test_data, 0)
        writer.close()
        return {"iteration": self.state.iteration, "eval_loss": last_eval, "stopped": stopped}

    def _save_for_rerun(self) -> None:
        """A non-finite result the rerun reproduced: the last completed iteration is saved
        (the step was not taken; RNG states as before it) so that the job can resume and
        run the step again elsewhere, as Megatron-LM does before its exit 16."""
        self.checks.restore_rng()
        self.zero.zero_grad()
        self.run.parts.zero.settle()
        if self.saver is None:
            log.warning("no --save: no checkpoint of iteration %d to resume from",
                        self.state.iteration)
        elif self.saver.last_saved != self.state.iteration:
            self.save()

    def _save_at_end(self, resumed: int, stopped: Optional[str]) -> None:
        it, saver = self.state.iteration, self.saver
        if saver is None:  # no --save
            return
        if it > resumed and saver.last_saved != it:
            self.save()
        saver.wait()  # a background save is committed before we go on
        if stopped:
            mark_saved_on_stop(self.rank, it)

    def _loop(self, writer: MetricsWriter, stop: StopConditions) -> tuple:
        cfg, t = self.cfg, self.cfg.train
        iters, gbs = filled(t.train_iters, "--train-iters"), filled(t.global_batch_size,
                                                                      "--global-batch-size")
        flops = flops_per_iteration(cfg.model, gbs)
        peak = peak_tflops(self.device, self.dtype, cfg.log.peak_tflops)
        log.info("peak %.1f TFLOP/s per device for MFU; %.2f TFLOP per iteration",
                 peak, flops / 1e12)
        window, scalars = Window(), IterationScalars(self.run)
        start_iter, t_start = self.state.iteration, time.perf_counter()
        last_eval = None
        while self.state.iteration < iters:
            batch = global_batch_at(t, self.state.consumed_train_samples)
            r, seconds, logged = self._step(batch)
            window.add(r, seconds, batch * cfg.model.seq_length)
            writer.scalars(scalars.after_step(self.state, r, seconds, logged, self.scaler))
            it = self.state.iteration
            if it % cfg.log.log_interval == 0 or it == iters:
                # a ramp-up's smaller batches take fewer FLOPs: the window's mean batch
                mean = window.tokens / (window.steps * cfg.model.seq_length)
                writer.write(iteration_record(self.run, self.state, window,
                                              flops * mean / gbs, peak,
                                              start_iter, t_start, self.scaler, logged))
                window = Window()
            self._count_skips(r, it)  # after the log: the stopping iteration is logged
            last_eval = self._after_step(writer, it, last_eval)
            reason = stop.reason(self.comm)
            if reason is not None:
                log.info("%s: stopping after iteration %d%s", reason, it,
                         " (saving a checkpoint)" if t.save else " (no --save: nothing saved)")
                return last_eval, reason
            if t.exit_interval and it % t.exit_interval == 0 and it < iters:
                log.info("--exit-interval %d: stopping after iteration %d", t.exit_interval, it)
                break
        return last_eval, None

    def _step(self, batch: int) -> tuple[StepResult, float, dict]:
        """One iteration of a global batch of `batch` samples at the schedule's learning
        rates; (its result, its seconds, its batch size and learning rates for the log)."""
        t, consumed = self.cfg.train, self.state.consumed_train_samples
        if self.saver is not None:
            self.saver.poll()  # commit a finished background save
        if t.rampup_batch_size is not None and batch != self.batch:
            log.info("global batch size %d from %d samples consumed on (--rampup-batch-size)",
                     batch, consumed)
        self.batch = batch
        set_lr(self.optimizer, self.schedule.group_lrs(self.state.iteration, consumed, batch))
        logged = {"global_batch_size": batch,
                  **self.schedule.logged(self.state.iteration, consumed, batch)}
        t0 = time.perf_counter()
        batches = self.train_data.micro_batches(consumed, batch)
        fault = None
        if self.fault is not None:
            fault = self.fault.hook(self.rank, self.state.iteration + 1)
            if fault and not self.fault.onwards:  # a transient fault: not met again by a rerun
                fault = first_call_only(fault)
        with self.profiler.step(self.state.iteration):
            r = train_step(self.model, batches, self.zero, self.scaler, t.clip_grad,
                           self.device, self.dtype, self.comm, self.pipeline,
                           t.check_for_nan_in_loss_and_grad, fault,
                           per_token_loss=t.calculate_per_token_loss,
                           log_params_norm=self.cfg.log.log_params_norm,
                           log_num_zeros=self.cfg.log.log_num_zeros_in_grad,
                           checks=self.checks, iteration=self.state.iteration + 1,
                           empty_cache_level=t.empty_unused_memory_level)
        seconds = time.perf_counter() - t0
        self.state.iteration += 1
        self.state.consumed_train_samples += batch
        self.state.skipped_iterations += int(r.skipped)
        return r, seconds, logged

    def _after_step(self, writer: MetricsWriter, it: int, last_eval: Optional[float]):
        """Evaluate and save when their intervals say so; the last evaluation's loss."""
        t = self.cfg.train
        done = it // t.eval_interval if t.eval_interval else 0  # evaluations due so far
        if t.eval_iters and self.valid_data and (
                (t.eval_interval and it % t.eval_interval == 0) or it == t.train_iters):
            gbs = filled(t.global_batch_size, "--global-batch-size")
            last_eval = self._eval(writer, "valid", self.valid_data, done * t.eval_iters * gbs)
        if t.save and t.save_interval and it % t.save_interval == 0:
            self.save()
        return last_eval

    def _count_skips(self, r: StepResult, it: int) -> None:
        """Log a step skipped for a non-finite loss or gradient norm; stop the run after
        --max-consecutive-skipped of them in a row (fp16: only those the loss scale can no
        longer absorb count)."""
        t = self.cfg.train
        if r.nonfinite and self.rank == 0 and not (r.skipped and
                                                   isinstance(self.scaler, LossScaler)):
            log.warning("iteration %d: a non-finite loss or gradient norm on some rank: %s",
                        it, "step skipped on every rank (the job's first step is not "
                        "validated)" if r.skipped else "step taken (not checked: "
                        "--no-check-for-nan-in-loss-and-grad)")
        counts = r.skipped and not (isinstance(self.scaler, LossScaler) and self.scaler.dynamic
                                    and self.scaler.scale > self.scaler.min_scale)
        self.consecutive_skipped = self.consecutive_skipped + 1 if counts else 0
        limit = t.max_consecutive_skipped
        if limit and self.consecutive_skipped >= limit:
            raise TrainingError(
                f"iteration {it}: {limit} steps in a row skipped for a non-finite loss or "
                f"gradient norm (--max-consecutive-skipped {limit}); stopped without saving"
                + (f" (the checkpoints in {t.save} are as they were)" if t.save else ""))

    def _eval(self, writer: MetricsWriter, split: str, data: BatchBuilder, first: int) -> float:
        loss = evaluate(self.model, data, first, self.cfg.train.eval_iters, self.device,
                        self.dtype, self.comm, self.pipeline,
                        empty_cache_level=self.cfg.train.empty_unused_memory_level)
        self.zero.reshard()  # ZeRO-2/3: parameters evaluation gathered are freed again
        log.info("%s loss at iteration %d: %.4f | ppl %.2f", split, self.state.iteration, loss,
                 math.exp(min(loss, 50.0)))
        key = "eval_loss" if split == "valid" else "test_loss"
        writer.write({"iteration": self.state.iteration, key: loss})
        return loss

    def generate(self) -> Optional[str]:
        """--generate tokens sampled from the trained model (rank 0; None elsewhere)."""
        return generate_text(self.run)


def nan_mode(t, scaler) -> str:
    """--check-for-nan-in-loss-and-grad under --rerun-mode (result_checks.NAN_MODES). Off
    under --fp16 with dynamic loss scaling, as Megatron-LM turns it off there: an overflow
    is the loss scaler's (the step skipped, the scale lowered)."""
    if not t.check_for_nan_in_loss_and_grad or (isinstance(scaler, LossScaler)
                                                and scaler.dynamic):
        return "off"
    return "raise" if t.rerun_mode == "disabled" else "validate"


def first_call_only(hook):
    """A test's fault hook that fires on the step's first pass only."""
    calls = []

    def once(grads):
        calls.append(1)
        if len(calls) == 1:
            hook(grads)
    return once
