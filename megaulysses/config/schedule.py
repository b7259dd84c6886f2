"""How long a run trains and what each step takes: Megatron-LM's iteration-based training
(--train-iters, --lr-decay-iters, --lr-warmup-iters) or its sample-based training
(--train-samples, --lr-decay-samples, --lr-warmup-samples, --rampup-batch-size).

Sample-based training counts in samples consumed: the learning rate's warm-up and decay,
and the global batch size of each step under --rampup-batch-size. A sample count need not
be a multiple of the global batch: as in Megatron-LM (training.update_train_iters) the run
takes whole global batches only, --train-samples // --global-batch-size of them (a partial
last batch is dropped); with a ramp-up, the steps while the batch grows plus as many whole
full-size batches as the remaining samples hold. The iterations are filled in once, here
(`resolve_schedule`); the trainer asks `global_batch_at` for each step's batch.

The ramp-up (Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator): the global batch
starts at START and grows by INCREMENT every SAMPLES / ((--global-batch-size - START) /
INCREMENT) consumed samples, reaching --global-batch-size once more than SAMPLES samples
are consumed. Each batch is a whole number of micro-batches per data-parallel rank, so the
micro-batches per step change with it.
"""

from __future__ import annotations

from dataclasses import replace
from megaulysses.config.errors import ConfigError, require
from megaulysses.config.fields import filled
from megaulysses.config.grid import ParallelDims
from megaulysses.config.schema import TrainConfig

# Neither --train-iters nor --train-samples given (Megatron-LM requires one): the bundled
# run's length.
TRAIN_ITERS = 200
RAMPUP = "--rampup-batch-size"


def check_schedule_flags(t: TrainConfig) -> None:
    """Megatron-LM's validate_args: iteration and sample flags do not mix; then the
    decoupled learning rate's own rules. Needs neither the grid nor the tokenizer."""
    if t.train_samples is None:
        # --rampup-batch-size is allowed with --train-iters, though Megatron-LM's
        # validate_args refuses the pair: its own GPT-3 175B example passes both. The run
        # then takes --train-iters steps whose batch ramps up; the learning rate counts
        # iterations (training/run.py says so in the log).
        for flag, given in (("--lr-decay-samples", t.lr_decay_samples is not None),
                            ("--lr-warmup-samples", t.lr_warmup_samples != 0)):
            require(not given, flag, "needs --train-samples (sample-based training; with "
                    "--train-iters the schedule counts iterations)")
    else:
        require(t.train_iters is None, "--train-samples", "cannot be combined with "
                "--train-iters (one of the two sets the run's length)")
        require(t.lr_decay_iters is None, "--lr-decay-iters", "counts iterations; with "
                "--train-samples use --lr-decay-samples")
        require(not t.lr_warmup_iters, "--lr-warmup-iters", "counts iterations; with "
                "--train-samples use --lr-warmup-samples")
        require(t.lr_warmup_fraction is None or not t.lr_warmup_samples,
                "--lr-warmup-fraction", "cannot be combined with --lr-warmup-samples")
        require(t.lr_warmup_samples >= 0, "--lr-warmup-samples",
                f"must be >= 0, got {t.lr_warmup_samples}")
        decay = t.lr_decay_samples or t.train_samples
        require(warmup_samples(t) <= decay, "--lr-warmup-samples", "must be in [0, "
                f"--lr-decay-samples or --train-samples = {decay}], got {warmup_samples(t)}")
    _check_decoupled(t)


def _check_decoupled(t: TrainConfig) -> None:
    if t.decoupled_lr is None:
        require(t.decoupled_min_lr is None, "--decoupled-min-lr", "needs --decoupled-lr")
        return
    require(t.decoupled_lr >= 0, "--decoupled-lr", f"must be >= 0, got {t.decoupled_lr}")
    floor = decoupled_min_lr(t)
    flag = "--decoupled-min-lr" if t.decoupled_min_lr is not None else "--decoupled-lr"
    require(0 <= floor <= t.decoupled_lr, flag, f"the decoupled learning rate decays from "
            f"--decoupled-lr {t.decoupled_lr} to {floor} (--decoupled-min-lr, default "
            "--min-lr): it must be in [0, --decoupled-lr]")


def decoupled_min_lr(t: TrainConfig) -> float:
    """Where the decoupled learning rate decays to: --decoupled-min-lr, else --min-lr."""
    return t.min_lr if t.decoupled_min_lr is None else t.decoupled_min_lr


def with_default_iters(t: TrainConfig) -> TrainConfig:
    """`t` with --train-iters' default where it is not given (the iteration rules read it;
    under --train-samples they have nothing left to refuse)."""
    return replace(t, train_iters=t.train_iters or TRAIN_ITERS)


def warmup_samples(t: TrainConfig) -> int:
    """--lr-warmup-fraction of the decay samples where given, else --lr-warmup-samples."""
    if t.lr_warmup_fraction is None:
        return t.lr_warmup_samples
    decay = filled(t.lr_decay_samples or t.train_samples, "--train-samples")
    return int(t.lr_warmup_fraction * decay)


def global_batch_at(t: TrainConfig, consumed: int) -> int:
    """The global batch of the step after `consumed` samples (`t` resolved): Megatron-LM's
    ramp-up, float arithmetic included, or --global-batch-size."""
    final = filled(t.global_batch_size, "--global-batch-size")
    if t.rampup_batch_size is None or consumed > t.rampup_batch_size[2]:
        return final
    start, increment, samples = t.rampup_batch_size
    per_increment = samples / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


def rampup_end(t: TrainConfig) -> tuple[int, int]:
    """(iterations, samples consumed) of the steps taken while the batch grows: every step
    that starts at or before the ramp's last sample (Megatron-LM's count)."""
    steps = consumed = 0
    samples = filled(t.rampup_batch_size, RAMPUP)[2]
    while consumed <= samples:
        consumed += global_batch_at(t, consumed)
        steps += 1
    return steps, consumed


def train_iters(t: TrainConfig) -> int:
    """Iterations of a run whose global batch is resolved: --train-iters, or whole global
    batches of --train-samples (the ramp's steps, then full-size ones)."""
    if t.train_samples is None:
        return t.train_iters or TRAIN_ITERS
    gbs = filled(t.global_batch_size, "--global-batch-size")
    if t.rampup_batch_size is None:
        iters = t.train_samples // gbs
        require(iters > 0, "--train-samples", f"{t.train_samples} is less than one global "
                f"batch (--global-batch-size {t.global_batch_size}): nothing to train")
        return iters
    steps, consumed = rampup_end(t)
    require(t.train_samples >= consumed, "--train-samples", f"{t.train_samples} ends inside "
            f"the batch-size ramp-up, whose {steps} steps take {consumed} samples "
            f"({RAMPUP}); give at least {consumed}")
    return steps + (t.train_samples - consumed) // gbs


def resolve_schedule(t: TrainConfig, dims: ParallelDims, pipeline_schedule: str) -> TrainConfig:
    """`t` (its global batch and iteration warm-up resolved) with the ramp-up checked on
    this grid and the run's iterations filled; under --train-samples the warm-up and decay
    in samples too (and none in iterations). Idempotent."""
    if t.rampup_batch_size is not None:
        check_rampup(t, dims, pipeline_schedule)
    t = replace(t, train_iters=train_iters(t))
    if t.train_samples is None:
        return t
    return replace(t, lr_warmup_iters=0, lr_warmup_samples=warmup_samples(t),
                   lr_decay_samples=t.lr_decay_samples or t.train_samples)


def check_rampup(t: TrainConfig, dims: ParallelDims, pipeline_schedule: str) -> None:
    """Megatron-LM's checks of the ramp (its calculator's asserts, made flag errors): it
    ends at --global-batch-size in whole increments, and every batch it takes is whole
    micro-batches on every data-parallel rank, as many as the pipeline schedule needs."""
    start, increment, _ = filled(t.rampup_batch_size, RAMPUP)
    final = filled(t.global_batch_size, "--global-batch-size")
    unit = t.micro_batch_size * dims.dp
    require(start < final, RAMPUP, f"START {start} must be below --global-batch-size {final} "
            "(the batch it ramps up to)")
    require((final - start) % increment == 0, RAMPUP, f"--global-batch-size {final} - START "
            f"{start} = {final - start} must be divisible by INCREMENT {increment}")
    for name, size in (("START", start), ("INCREMENT", increment)):
        require(size % unit == 0, RAMPUP, f"{name} {size} must be divisible by "
                f"--micro-batch-size * dp = {t.micro_batch_size}*{dims.dp}")
    if dims.pp > 1:
        for size in range(start, final, increment):
            try:
                check_micro_batches(dims, size // unit, pipeline_schedule)
            except ConfigError as e:
                rule = str(e).split(": ", 1)[1].replace("--global-batch-size", "the batch")
                raise ConfigError(RAMPUP, f"its global batch {size} {rule}") from None


def check_micro_batches(dims: ParallelDims, n: int, schedule: str) -> None:
    """Micro-batches per step = global batch / (micro batch * dp), per schedule."""
    why = f"gives {n} micro-batches per pipeline (--global-batch-size / " \
          f"(--micro-batch-size * dp))"
    if schedule == "1f1b" and n < dims.pp:
        raise ConfigError("--global-batch-size", f"{why}; 1f1b needs at least pp = "
                          f"{dims.pp}")
    if schedule in ("interleaved-1f1b", "zero-bubble") and n % dims.pp:
        raise ConfigError("--global-batch-size", f"{why}; {schedule} needs a multiple "
                          f"of pp = {dims.pp}")


def schedule_position(t: TrainConfig, iteration: int, consumed: int,
                      batch: int) -> tuple[int, int]:
    """Where the learning-rate schedule stands for a step, in its units: (iterations done,
    1), or (samples consumed, the step's batch) under --train-samples."""
    return (iteration, 1) if t.train_samples is None else (consumed, batch)
