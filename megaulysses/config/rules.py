"""Every rule a run's flags must keep, as plain functions; each raises ConfigError(flag,
rule) naming the flag, one line. `validate` holds the rules of the flags alone (parse_args
runs it); `check_grid` and `check_ring` those that need the grid and the vocabulary too
(resolve runs them); `pipeline_layout` splits the layers over the pipeline stages.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional

from megaulysses.config.errors import ConfigError, require
from megaulysses.config.fields import filled
from megaulysses.config.grid import ParallelDims
from megaulysses.config.rules_memory import check_head_groups, check_offload
from megaulysses.config.rules_offload import check_param_offload
from megaulysses.config.rules_optim import validate_optimizer
from megaulysses.config.rules_rope import validate_rope
from megaulysses.config.schedule import (check_micro_batches, check_schedule_flags,
                                         with_default_iters)
from megaulysses.config.schema import (BUNDLED_TOKENIZER, Config, DataConfig, LogConfig,
                                       MemoryConfig, ModelConfig, ParallelConfig, TrainConfig)


def validate(cfg: Config) -> None:
    """Every cross-flag rule that needs neither the world size nor the tokenizer. Files are
    checked later, where they are opened. Changes nothing: resolve() fills the values
    these rules derive (warm-up, schedule, recomputed layers)."""
    _validate_model(cfg.model)
    _validate_attention_mask(cfg.model)
    check_schedule_flags(cfg.train)  # iterations or samples, and --decoupled-lr
    _validate_train(with_default_iters(cfg.train), cfg.model)
    _validate_data(cfg.data)
    require(cfg.log.peak_tflops is None or cfg.log.peak_tflops > 0, "--peak-tflops",
             f"must be > 0, got {cfg.log.peak_tflops}")
    _validate_observability(cfg.log, cfg.train.save)
    _validate_pipeline(cfg.parallel)
    validate_optimizer(cfg)  # rules_optim.py
    check_param_offload(cfg)  # rules_offload.py
    backend = cfg.model.attention_backend
    # Needs no device, so --dry-run refuses it too (the trainer checks the rest: which
    # backend this device runs, for the mask).
    require(cfg.parallel.context_parallel_size == 1 or backend in ("auto", "block"),
             "--attention-backend", f"{backend}: ring attention (--context-parallel-size > 1) "
             "runs its own block kernel; use auto or block")
    timeout = cfg.parallel.distributed_timeout_minutes
    require(math.isfinite(timeout) and timeout > 0, "--distributed-timeout-minutes",
             f"must be > 0, got {timeout}")
    layout = pipeline_layout(cfg.model.num_layers, cfg.parallel)  # raises if it does not fit
    _validate_memory(cfg.memory, layout)


def _validate_model(m: ModelConfig):
    if m.kv_channels is None:
        require(m.hidden_size % m.num_attention_heads == 0, "--hidden-size",
                 f"must be divisible by --num-attention-heads "
                 f"({m.hidden_size} % {m.num_attention_heads} != 0)")
    # More groups than heads first: the divisibility rule below would blame the heads.
    require(m.num_kv_heads <= m.num_attention_heads, "--num-query-groups",
             f"must be <= --num-attention-heads ({m.num_kv_heads} > {m.num_attention_heads})")
    require(m.num_attention_heads % m.num_kv_heads == 0, "--num-attention-heads",
             f"must be divisible by --num-query-groups "
             f"({m.num_attention_heads} % {m.num_kv_heads} != 0)")
    if m.position_embedding_type == "rope":
        # Name the flag the user gave: the head dimension is --kv-channels or hidden/heads.
        require(m.head_dim % 2 == 0, "--kv-channels" if m.kv_channels else "--hidden-size",
                 f"rope needs an even head dimension, got {m.head_dim}" + (
                     "" if m.kv_channels else f" = {m.hidden_size} / {m.num_attention_heads} "
                     "heads (or set --kv-channels)"))
        require(m.rotary_base > 0, "--rotary-base", f"must be > 0, got {m.rotary_base}")
    validate_rope(m, m.position_embedding_type)  # the RoPE scalings (rules_rope.py)
    require(m.seq_length <= m.max_positions, "--seq-length",
             f"must be <= --max-position-embeddings ({m.seq_length} > {m.max_positions})")
    for flag, p in (("--hidden-dropout", m.hidden_dropout),
                    ("--attention-dropout", m.attention_dropout)):
        require(0.0 <= p < 1.0, flag, f"must be in [0, 1), got {p}")
    require(m.norm_epsilon > 0, "--norm-epsilon", f"must be > 0, got {m.norm_epsilon}")
    require(m.init_method_std > 0, "--init-method-std", f"must be > 0, got {m.init_method_std}")


def _validate_attention_mask(m: ModelConfig):
    """The mask's own rules; which backend runs it, and the sequence slices each rank sees,
    are checked where the device and the grid are known (attention.select_backend,
    ParallelDims.validate)."""
    if m.attention_sparsity == "dense":
        return
    flag = "--sparse-block-size"
    require(m.seq_length % m.sparse_block_size == 0, flag,
             f"{m.sparse_block_size} must divide --seq-length {m.seq_length}")
    require(m.sparse_global_blocks >= 0, "--sparse-global-blocks",
             f"must be >= 0, got {m.sparse_global_blocks}")
    require(m.sparse_random_blocks >= 0, "--sparse-random-blocks",
             f"must be >= 0, got {m.sparse_random_blocks}")
    if m.attention_sparsity == "fixed":
        require(m.sparse_global_blocks <= m.sparse_local_blocks, "--sparse-global-blocks",
                 f"{m.sparse_global_blocks} summary blocks do not fit in a window of "
                 f"--sparse-local-blocks {m.sparse_local_blocks}")


def _validate_train(t: TrainConfig, m: ModelConfig):
    gbs = t.global_batch_size
    require(gbs is None or gbs % t.micro_batch_size == 0, "--global-batch-size",
             f"must be divisible by --micro-batch-size ({gbs} % {t.micro_batch_size} != 0)")
    require(not (t.bf16 and t.fp16), "--bf16", "cannot be combined with --fp16")
    require(t.lr >= 0, "--lr", f"must be >= 0, got {t.lr}")
    require(0 <= t.min_lr <= t.lr, "--min-lr", f"must be in [0, --lr], got {t.min_lr}")
    # Megatron-LM's rule: a warm-up fraction leaves --lr-warmup-iters at its default 0
    require(t.lr_warmup_fraction is None or not t.lr_warmup_iters, "--lr-warmup-fraction",
            "cannot be combined with --lr-warmup-iters")
    decay = filled(t.lr_decay_iters or t.train_iters, "--train-iters")  # with_default_iters
    frac = t.lr_warmup_fraction
    require(frac is None or 0 <= frac <= 1, "--lr-warmup-fraction",
            f"must be in [0, 1], got {frac}")
    warmup = warmup_iters(t)
    require(0 <= warmup <= decay, "--lr-warmup-iters",
            f"must be in [0, --lr-decay-iters or --train-iters = {decay}], got {warmup}")
    require(t.weight_decay >= 0, "--weight-decay", f"must be >= 0, got {t.weight_decay}")
    for flag, beta in (("--adam-beta1", t.adam_beta1), ("--adam-beta2", t.adam_beta2)):
        require(0 <= beta < 1, flag, f"must be in [0, 1), got {beta}")  # else AdamW raises
    require(t.adam_eps > 0, "--adam-eps", f"must be > 0, got {t.adam_eps}")
    require(t.clip_grad >= 0, "--clip-grad", f"must be >= 0, got {t.clip_grad}")
    require(t.eval_iters >= 0, "--eval-iters", f"must be >= 0, got {t.eval_iters}")
    require(t.generate >= 0, "--generate", f"must be >= 0, got {t.generate}")
    require(t.max_consecutive_skipped >= 0, "--max-consecutive-skipped",
             f"must be >= 0, got {t.max_consecutive_skipped}")
    require(t.rerun_mode != "report_stats", "--rerun-mode", "report_stats: Megatron-LM's "
            "statistics of run-to-run differences (every step run twice) are not provided "
            "here; validate_results or disabled")
    require(t.generate_temperature > 0, "--generate-temperature",
             f"must be > 0, got {t.generate_temperature}")
    require(t.generate_top_k >= 0, "--generate-top-k",
             f"must be >= 0 (0: all tokens), got {t.generate_top_k}")
    require(t.loss_scale is None or t.loss_scale > 0, "--loss-scale",
             f"must be > 0, got {t.loss_scale}")
    require(t.min_loss_scale > 0, "--min-loss-scale", f"must be > 0, got {t.min_loss_scale}")
    require(t.initial_loss_scale >= t.min_loss_scale, "--initial-loss-scale",
             f"must be >= --min-loss-scale ({t.initial_loss_scale} < {t.min_loss_scale})")
    for flag, value in (("--keep-last", t.keep_last),
                        ("--save-retain-interval", t.save_retain_interval),
                        ("--async-save", t.async_save)):
        require(not value or t.save is not None, flag, "needs --save DIR")
    require(t.exit_duration_in_mins is None or t.exit_duration_in_mins > 0,
             "--exit-duration-in-mins", f"must be > 0, got {t.exit_duration_in_mins}")


def warmup_iters(t: TrainConfig) -> int:
    """--lr-warmup-fraction of the decay iterations where given, else --lr-warmup-iters."""
    if t.lr_warmup_fraction is None:
        return t.lr_warmup_iters
    return int(t.lr_warmup_fraction * filled(t.lr_decay_iters or t.train_iters, "--train-iters"))


def pipeline_schedule(par: ParallelConfig) -> str:
    """--pipeline-schedule, or its default: interleaved-1f1b with virtual stages, else 1f1b."""
    if par.pipeline_schedule is not None:
        return par.pipeline_schedule
    return "interleaved-1f1b" if par.num_layers_per_virtual_pipeline_stage else "1f1b"


def _validate_pipeline(par: ParallelConfig):
    pp, vl = par.pipeline_model_parallel_size, par.num_layers_per_virtual_pipeline_stage
    uneven = (par.decoder_first_pipeline_num_layers is not None
              or par.decoder_last_pipeline_num_layers is not None)
    schedule = pipeline_schedule(par)
    if pp == 1:
        require(vl is None and not uneven, "--pipeline-model-parallel-size",
                 "virtual stages and uneven stage splits need --pipeline-model-parallel-size > 1")
        return
    if schedule in ("1f1b", "gpipe"):
        require(vl is None, "--num-layers-per-virtual-pipeline-stage",
                f"--pipeline-schedule {schedule} runs one stage per rank; use "
                "interleaved-1f1b or zero-bubble with virtual stages")
    if schedule == "interleaved-1f1b":
        require(vl is not None, "--pipeline-schedule",
                 "interleaved-1f1b needs --num-layers-per-virtual-pipeline-stage")
    require(not (uneven and vl), "--decoder-first-pipeline-num-layers",
             "uneven stage splits cannot be combined with "
             "--num-layers-per-virtual-pipeline-stage")


def _validate_memory(mem: MemoryConfig, layout: list[list[int]]):
    """Recompute flags (Megatron-LM's rules). The tiled MLP's rule needs the grid: it is
    checked in ParallelDims.validate."""
    require(mem.dry_run_world_size is None or mem.dry_run, "--dry-run-world-size",
             "needs --dry-run")
    require(mem.dry_run_device is None or mem.dry_run, "--dry-run-device", "needs --dry-run")
    require(mem.dry_run_gpu is None or mem.dry_run, "--dry-run-gpu", "needs --dry-run")
    require(mem.dry_run_gpu is None or mem.dry_run_device != "cpu", "--dry-run-gpu",
             "plans for cuda; drop --dry-run-device cpu")
    full = mem.recompute_granularity == "full"
    for flag, value in (("--recompute-method", mem.recompute_method),
                        ("--recompute-num-layers", mem.recompute_num_layers)):
        require(value is None or full, flag, "needs --recompute-granularity full "
                 f"(got {mem.recompute_granularity or 'no recomputation'})")
    fewest = min(len(stage) for stage in layout if stage)
    check_offload(mem, fewest)  # rules_memory.py
    if not full:
        return
    layers = mem.recompute_num_layers or 1
    require(layers <= fewest, "--recompute-num-layers",
            f"{layers} is more than the {fewest} layers of a pipeline stage (it counts "
            "layers per stage)")


def pipeline_layout(num_layers: int, par: ParallelConfig) -> list[list[int]]:
    """Layer indices of each pipeline stage, stage 0 first (pp * virtual stages in all).

    Stage s runs on pipeline rank s % pp (the loop order of the interleaved schedules), so
    with v virtual stages rank r holds stages r, r + pp, ... Even split by default; with
    --decoder-first/last-pipeline-num-layers those stages get what they ask for and the
    stages between share the rest evenly. Raises ConfigError when it does not divide.
    """
    pp, vl = par.pipeline_model_parallel_size, par.num_layers_per_virtual_pipeline_stage
    first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
    if vl is not None:
        require(num_layers % (pp * vl) == 0, "--num-layers-per-virtual-pipeline-stage",
                 f"--num-layers {num_layers} must be divisible by pp * "
                 f"{vl} layers per virtual stage = {pp * vl}")
        sizes = [vl] * (num_layers // vl)
    elif first is None and last is None:
        require(num_layers % pp == 0, "--pipeline-model-parallel-size",
                 f"--num-layers {num_layers} must be divisible by the {pp} pipeline stages "
                 "(or set --decoder-first/last-pipeline-num-layers)")
        sizes = [num_layers // pp] * pp
    else:
        sizes = _uneven_sizes(num_layers, pp, first, last)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [list(range(a, a + n)) for a, n in zip(starts, sizes, strict=True)]


def _uneven_sizes(num_layers: int, pp: int, first: Optional[int], last: Optional[int]):
    for flag, n in (("--decoder-first-pipeline-num-layers", first),
                    ("--decoder-last-pipeline-num-layers", last)):
        require(n is None or 0 <= n <= num_layers, flag,
                 f"must be in [0, --num-layers {num_layers}], got {n}")
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle == 0:
        require(rest == 0, "--decoder-first-pipeline-num-layers",
                 f"with {pp} stages the first and last stage must hold all {num_layers} "
                 f"layers, got {first} + {last}")
        return [first, last]
    require(rest >= middle and rest % middle == 0, "--decoder-first-pipeline-num-layers",
             f"the {rest} layers left after the first/last stage must split evenly, at least "
             f"one each, over the other {middle} stages")
    each = rest // middle
    return ([first] if first is not None else []) + [each] * middle + (
        [last] if last is not None else [])


def _validate_data(d: DataConfig):
    """The flags' own syntax; the files are checked where they are opened (training/data.py).
    Checked here too so that --dry-run, which opens no data, refuses what training would."""
    from megaulysses.data.gpt_dataset import parse_data_path, parse_split  # numpy, no torch
    try:
        weights = parse_split(d.split)
    except ValueError as e:
        raise ConfigError("--split", str(e).removeprefix("--split:").strip()) from None
    require(weights[0] > 0, "--split", f"the train split must not be empty, got {d.split}")
    if not d.mock_data:
        # parse_args gives the bundled data when there is no data source; a Config built in
        # Python must name one (checked before parsing: None is no list of prefixes)
        if not d.data_path:
            raise ConfigError("--data-path", "required (or --mock-data)")
        try:
            parse_data_path(d.data_path)
        except ValueError as e:
            raise ConfigError("--data-path", str(e).removeprefix("--data-path:").strip()) from None
    _validate_tokenizer(d)
    require(d.num_workers >= 0, "--num-workers", f"must be >= 0, got {d.num_workers}")
    require(d.dataloader_type != "external", "--dataloader-type", "external: Megatron-LM's "
            "pass-through of a user's own data loader is not provided here (single or cyclic)")


def _validate_tokenizer(d: DataConfig):
    """Each tokenizer type's files (mock data too: the tokenizer sets the vocabulary). That
    they exist and read is checked where they are opened (training/data.py)."""
    if d.tokenizer_type == "NullTokenizer":
        require(d.vocab_size is not None, "--vocab-size", "required with NullTokenizer")
    elif d.tokenizer_type == "SentencePieceTokenizer":
        require(d.tokenizer_model is not None, "--tokenizer-model",
                 f"required with {d.tokenizer_type}")
    hf = d.tokenizer_type == "HuggingFaceTokenizer"
    # (the default --tokenizer-model is the bundled SentencePiece model, no tokenizer.json)
    require(not hf or d.tokenizer_model not in (None, BUNDLED_TOKENIZER), "--tokenizer-model",
            "required with HuggingFaceTokenizer: a directory holding tokenizer.json, or the file")
    special = d.tokenizer_hf_include_special_tokens  # None: not given
    for flag, given in (("--eod-token-id", d.eod_token_id is not None),
                        ("--tokenizer-hf-" + ("" if special else "no-") +
                         "include-special-tokens", special is not None)):
        require(hf or not given, flag, "is only used with --tokenizer-type "
                f"HuggingFaceTokenizer (this run's is {d.tokenizer_type})")
    require(d.eod_token_id is None or d.eod_token_id >= 0, "--eod-token-id",
            f"must be >= 0, got {d.eod_token_id}")
    gpt2 = d.tokenizer_type == "GPT2BPETokenizer"
    for flag, path in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)):
        require(path is not None or not gpt2, flag, "required with GPT2BPETokenizer")
        # Megatron-LM ignores them with other types, but there --tokenizer-type has no
        # default: here it would mean training silently with the default SentencePiece one.
        require(path is None or gpt2, flag, "is only used with --tokenizer-type "
                 f"GPT2BPETokenizer (this run's is {d.tokenizer_type})")


def check_grid(dims: ParallelDims, m: ModelConfig, global_batch_size: int,
               micro_batch_size: int, sequence_parallel: bool = False,
               pipeline_schedule: str = "1f1b", tiled_mlp_chunks: int = 1,
               head_groups: int = 1) -> None:
    """Rules that depend on the grid and the model together (one message each).
    `sequence_parallel`: Megatron-SP in effect."""
    sp_flag, tp_flag = "--ds-sequence-parallel-size", "--tensor-model-parallel-size"
    for size, flag in ((m.ffn_size, "--ffn-hidden-size"),
                       (m.padded_vocab_size, "--make-vocab-size-divisible-by")):
        if size % dims.tp:
            raise ConfigError(flag, f"{flag[2:].replace('-', ' ')} result {size} must be "
                              f"divisible by {tp_flag} {dims.tp}")
    if sequence_parallel and m.seq_length % (dims.tp * dims.seq_degree):
        raise ConfigError("--sequence-parallel", f"--seq-length {m.seq_length} must be "
                          f"divisible by tp*sp*cp = {dims.tp * dims.seq_degree}")
    if m.num_attention_heads % (dims.tp * dims.sp):
        raise ConfigError(sp_flag if dims.sp > 1 else tp_flag,
                          f"--num-attention-heads {m.num_attention_heads} must be "
                          f"divisible by tp*sp = {dims.tp}*{dims.sp}")
    kv_per_tp = m.num_kv_heads // dims.tp if m.num_kv_heads % dims.tp == 0 else None
    if kv_per_tp is None:
        raise ConfigError("--num-query-groups", f"{m.num_kv_heads} kv heads must be "
                          f"divisible by --tensor-model-parallel-size {dims.tp}")
    if kv_per_tp % dims.sp and dims.sp % kv_per_tp:
        raise ConfigError(sp_flag, f"kv heads per tensor rank ({kv_per_tp}) and sp = "
                          f"{dims.sp} must divide one another (GQA under Ulysses)")
    if m.seq_length % dims.sp:
        raise ConfigError(sp_flag, f"--seq-length {m.seq_length} must be divisible by "
                          f"sp = {dims.sp}")
    if dims.cp > 1 and m.seq_length % (2 * dims.cp * dims.sp):
        raise ConfigError("--context-parallel-size", f"--seq-length {m.seq_length} must "
                          f"be divisible by 2*cp*sp = 2*{dims.cp}*{dims.sp} (each rank "
                          "holds two zigzag chunks)")
    local = m.seq_length // dims.seq_degree // (dims.tp if sequence_parallel else 1)
    if tiled_mlp_chunks > local or local % tiled_mlp_chunks:
        raise ConfigError("--tiled-mlp-chunks", f"{tiled_mlp_chunks} must divide the "
                          f"local sequence of {local} tokens (--seq-length / sp / cp"
                          f"{' / tp under --sequence-parallel' if sequence_parallel else ''})")
    check_head_groups(dims, m, head_groups)  # rules_memory.py
    if global_batch_size % (micro_batch_size * dims.dp):
        raise ConfigError("--global-batch-size", f"{global_batch_size} must be divisible "
                          f"by --micro-batch-size * dp = {micro_batch_size}*{dims.dp}")
    if dims.pp > 1:
        check_micro_batches(dims, global_batch_size // (micro_batch_size * dims.dp),
                            pipeline_schedule)

def check_ring(dims: ParallelDims, m: ModelConfig) -> None:
    """What ring attention (cp > 1) needs of the mask and the model."""
    if dims.cp == 1:
        return
    chunk = m.seq_length // (2 * dims.cp)  # one zigzag chunk: a ring step's block rows
    if m.attention_sparsity != "dense" and chunk % m.sparse_block_size:
        raise ConfigError("--sparse-block-size", f"{m.sparse_block_size} must divide the "
                          f"sequence chunk of each ring step, --seq-length / (2*cp) = "
                          f"{chunk}")


def _validate_observability(log: LogConfig, save: Optional[str]) -> None:
    """The profiler's steps and output, and what wandb needs (issue 28); the profiled ranks
    need the world size (`check_profile_ranks`)."""
    start, end = log.profile_step_start, log.profile_step_end
    require(start >= 0, "--profile-step-start", f"must be >= 0, got {start}")
    require(end > start, "--profile-step-end",
            f"must be > --profile-step-start {start} (the trace holds the steps between), "
            f"got {end}")
    require(min(log.profile_ranks, default=0) >= 0, "--profile-ranks",  # []: every rank
            f"ranks must be >= 0, got {min(log.profile_ranks, default=0)}")
    require(not log.profile or bool(log.tensorboard_dir), "--profile",
            "needs --tensorboard-dir: the trace is written to "
            "<--tensorboard-dir>/../torch_profile, as in Megatron-LM")
    if not log.wandb_project:
        return
    require(bool(log.wandb_exp_name), "--wandb-exp-name",
            "required with --wandb-project (the run's name)")
    require(bool(log.wandb_save_dir or save), "--wandb-save-dir",
            "required with --wandb-project when there is no --save (default: <--save>/wandb)")
    # last: the rules above hold whether or not this machine has the package
    require(importlib.util.find_spec("wandb") is not None, "--wandb-project",
            "needs the wandb package, which is not installed (pip install wandb)")


def check_profile_ranks(log: LogConfig, world: int) -> None:
    """--profile-ranks must name ranks of this world."""
    outside = [r for r in log.profile_ranks if r >= world]
    require(not (log.profile and outside), "--profile-ranks",
            f"rank {outside[0] if outside else 0} is outside the world of {world} "
            f"rank{'s' if world > 1 else ''} (0..{world - 1})")
