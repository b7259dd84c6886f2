"""The training section of the run's settings (schema.py's Config.train): batch,
iterations, learning rate and its schedule, the optimizer, precision, checkpoints,
evaluation and sampling. Declared as schema.py declares the others."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaulysses.config.fields import option

LR_DECAY_STYLES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = option(8, "samples per forward/backward on a rank", kind="positive")
    global_batch_size: Optional[int] = option(
        None, "samples per iteration over all data-parallel ranks (default: --micro-batch-size x "
        "dp, x pp under a pipeline: no accumulation)", kind="positive")
    rampup_batch_size: Optional[list] = option(
        None, "the global batch starts at START and grows by INCREMENT over SAMPLES consumed "
        "samples up to --global-batch-size (Megatron-LM's ramp-up; needs --train-samples)",
        kind="positive", nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
    train_iters: Optional[int] = option(  # None: 200, or from --train-samples (resolve())
        None, "iterations (optimizer steps) to train; default: 200 without --train-samples",
        kind="positive")
    train_samples: Optional[int] = option(
        None, "samples to train on instead of --train-iters (Megatron-LM's sample-based "
        "training: the schedule counts samples); whole global batches, a partial last one "
        "is dropped", kind="positive")
    lr: float = option(0.002, "peak learning rate", kind="number")
    min_lr: float = option(
        0.0, "learning rate at the end of the decay, in [0, --lr]", kind="number")
    decoupled_lr: Optional[float] = option(
        None, "peak learning rate of the input embedding and the output layer (Megatron-LM's), "
        "on --lr's schedule; default: --lr", kind="number")
    decoupled_min_lr: Optional[float] = option(
        None, "--decoupled-lr's learning rate at the end of the decay; default: --min-lr",
        kind="number")
    lr_decay_style: str = option(
        "linear", "from --lr down to --min-lr after the warmup",
        choices=LR_DECAY_STYLES)
    lr_warmup_iters: int = option(0, "iterations of linear warmup", kind="int")
    lr_warmup_init: float = option(
        0.0, "learning rate the warmup starts from (its first step's), rising linearly to "
        "--lr", kind="number")
    lr_warmup_samples: int = option(
        0, "samples of linear warmup (with --train-samples)", kind="int")
    lr_warmup_fraction: Optional[float] = option(
        None, "warmup as a fraction of the decay iterations (samples with --train-samples), "
        "instead of --lr-warmup-iters",
        kind="number")
    lr_decay_iters: Optional[int] = option(
        None, "iterations over which the learning rate decays (warmup included); default: "
        "--train-iters", kind="positive")
    lr_decay_samples: Optional[int] = option(
        None, "samples over which the learning rate decays (warmup included; with "
        "--train-samples); default: --train-samples", kind="positive")
    weight_decay: float = option(0.01, "AdamW weight decay (not on biases and norms)", kind="number")
    adam_beta1: float = option(0.9, "AdamW beta1, in [0, 1)", kind="number")
    adam_beta2: float = option(0.999, "AdamW beta2, in [0, 1)", kind="number")
    adam_eps: float = option(1e-08, "AdamW epsilon, > 0", kind="number")
    clip_grad: float = option(
        1.0, "clip the global gradient norm to this; 0 disables clipping", kind="number")
    bf16: bool = option(False, "bfloat16 autocast (fp32 weights)", action="store_true")
    fp16: bool = option(
        False, "float16 autocast (fp32 weights) with loss scaling", action="store_true")
    loss_scale: Optional[float] = option(
        None, "--fp16: a static loss scale; default: none (dynamic scaling)", kind="number")
    initial_loss_scale: float = option(
        4294967296.0, "--fp16 dynamic scaling: the scale to start from (2^32)", kind="number")
    min_loss_scale: float = option(
        1.0, "--fp16 dynamic scaling: the scale never falls below this", kind="number")
    loss_scale_window: int = option(
        1000, "--fp16 dynamic scaling: steps without overflow before the scale doubles",
        kind="positive")
    hysteresis: int = option(
        2, "--fp16 dynamic scaling: overflows tolerated before the scale halves", kind="positive")
    seed: int = option(
        1234, "seed of the initial weights, data order, dropout and sampling", kind="int")
    eval_interval: Optional[int] = option(
        1000, "evaluate on the valid split every this many iterations (and once training "
        "ends)", kind="positive")
    eval_iters: int = option(100, "global batches per evaluation; 0 disables evaluation", kind="int")
    save: Optional[str] = option(None, "checkpoint directory to save to")
    load: Optional[str] = option(
        None, "checkpoint directory (or iter_XXXXXXX directory) to resume from: ours, or a "
        "Megatron-LM save directory (torch_dist or torch format, converted on the fly)")
    use_checkpoint_args: bool = option(
        False, "the model flags come from the --load checkpoint (ours or Megatron-LM's); a "
        "model flag given that contradicts it is an error", action="store_true")
    exit_on_missing_checkpoint: bool = option(
        False, "with --load: exit (2) when it holds no checkpoint, even where --save names "
        "the same directory (otherwise that starts from scratch)", action="store_true")
    save_interval: Optional[int] = option(
        None, "with --save: save every this many iterations; default: at the end only",
        kind="positive", names=("--save-interval", "--persistent-save-interval"))
    exit_interval: Optional[int] = option(
        None, "stop after the first iteration divisible by this (saving with --save)",
        kind="positive")
    exit_duration_in_mins: Optional[float] = option(
        None, "save (with --save) and stop once the run has lasted this long", kind="number")
    exit_signal_handler: Optional[bool] = option(  # None: on under SLURM (resolve())
        None, "on SIGTERM or SIGUSR1 every rank finishes the current step, saves (with --save) "
        "and exits 0; default: on under SLURM", action="optional")
    keep_last: Optional[int] = option(
        None, "keep only the newest N committed checkpoints (default: all)", kind="positive")
    save_retain_interval: Optional[int] = option(
        None, "with --save: keep the checkpoints whose iteration is a multiple of this, and "
        "the latest; the others are removed once a newer checkpoint is committed (Megatron-"
        "LM's; with --keep-last, a checkpoint either keeps stays)", kind="positive")
    async_save: bool = option(
        False, "write checkpoints in a background thread while training goes on",
        action="store_true")
    no_load_optim: bool = option(
        False, "load only the model (and RNG) from --load: a fresh optimizer", action="store_true")
    no_load_rng: bool = option(
        False, "do not restore the RNG states saved in --load", action="store_true")
    no_save_optim: bool = option(
        False, "checkpoints without the optimizer state (loading one needs --no-load-optim)",
        action="store_true")
    no_save_rng: bool = option(
        False, "checkpoints without the RNG states (loading one needs --no-load-rng)",
        action="store_true")
    calculate_per_token_loss: bool = option(
        False, "the gradient of the global batch's loss summed over tokens / its loss-token "
        "count (every token weighs alike); default: of each micro-batch's mean over its own "
        "loss tokens, averaged over the micro-batches (as Megatron-LM). The logged loss is the "
        "per-token mean either way", action="store_true")
    generate: int = option(
        0, "sample this many tokens from the trained model at the end; 0: off (the run without "
        "flags samples 200)", kind="int")
    check_for_nan_in_loss_and_grad: bool = option(
        True, "a non-finite loss or gradient norm on any rank stops the run (--rerun-mode "
        "says how; the job's first step is skipped instead: not validated); off, and under "
        "--fp16 with dynamic loss scaling (an overflow lowers the scale and skips the step): "
        "not checked, the step is taken", action="optional")
    rerun_mode: str = option(
        "validate_results", "validate_results: a step with a non-finite loss or gradient "
        "norm is run again in place; reproduced, a checkpoint of the last iteration is saved "
        "and the run exits 16 (resume it elsewhere to tell a faulty device from the model), "
        "else it exits 17 (a transient fault: resume from the last checkpoint); disabled: "
        "exit 1 at once, no rerun; report_stats (Megatron-LM's run-to-run difference "
        "statistics) is not provided", choices=("disabled", "validate_results", "report_stats"))
    check_for_spiky_loss: bool = option(
        False, "a loss 10 times the largest of the first 100 steps (the job's first step not "
        "counted) runs its step again before the optimizer steps, and says whether the rerun "
        "reproduced it; training goes on with the rerun (Megatron-LM's result validation)",
        action="store_true")
    check_for_large_grads: bool = option(
        False, "the same for the gradient norm (tolerance 0.001 between the runs)",
        action="store_true")
    empty_unused_memory_level: int = option(
        0, "CUDA: torch.cuda.empty_cache() after each step's forward and backward passes and "
        "each evaluation iteration (1), and after the optimizer step too (2), as Megatron-LM; "
        "0: never", kind="int", choices=(0, 1, 2))
    max_consecutive_skipped: int = option(
        10, "stop with an error after this many skipped steps in a row, leaving the last "
        "checkpoint as it was (0: never; with --fp16 dynamic loss scaling, skips while the scale "
        "can still fall do not count)", kind="int")
    deterministic: bool = option(
        False, "CUDA: deterministic kernels only (docs/determinism.md says what it switches on "
        "and costs); CPU runs are bit-identical without it", action="store_true",
        names=("--deterministic", "--deterministic-mode"))
    generate_prompt: str = option(
        "", "--generate: the text the sample continues (default: empty, from the end-of-document "
        "token)")
    generate_temperature: float = option(0.8, "--generate: softmax temperature, > 0", kind="number")
    generate_top_k: int = option(
        40, "--generate: sample among the k likeliest tokens; 0: all", kind="int")
