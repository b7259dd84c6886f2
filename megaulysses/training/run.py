"""Building a run: from the flags to everything the loop needs, once (`build_run`).

The order matters and is the same for every caller: seeds, device, determinism and TF32
(before the process group and the first matmul), output checks (refusing is quick), the
process group, the tokenizer, `resolve` (the frozen RunConfig: every derived value and
every grid rule), the attention kernel for this device, the mesh, the data, then the model
on the meta device, parallelized. `--dry-run` shares `resolve_run` and `attention_backend`.
"""

from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np
import torch

from megaulysses.config import Config, ConfigError, RunConfig, resolve
from megaulysses.config.fields import filled
from megaulysses.config.compat import CompatConfig
from megaulysses.config.megatron import given_lines
from megaulysses.config.summary import format_settings
from megaulysses.data.loader import BatchBuilder
from megaulysses.data.tokenizer import Tokenizer
from megaulysses.data.workers import WorkerBatches, with_workers
from megaulysses.model.attention import mask_from_config, select_backend
from megaulysses.model.gpt import GPT
from megaulysses.model.ops.kernels import select_kernels
from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dist_opt_plan import describe as describe_dist_opt
from megaulysses.parallel.dims import CP, DP, SP, build_mesh, init_distributed
from megaulysses.parallel.ring import local_positions
from megaulysses.training import determinism, precision
from megaulysses.training.data import build_datasets, load_tokenizer
from megaulysses.training.device import pick_device
from megaulysses.training.optim import adamw, param_groups
from megaulysses.training.outputs import check_outputs
from megaulysses.training.storage import check_writable

if TYPE_CHECKING:  # parallelize pulls in FSDP, DTensor and pipelining: not for --dry-run
    from megaulysses.parallel.parallelize import Parallelized

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What a training run is made of; built once by `build_run`."""
    cfg: RunConfig
    device: torch.device
    dtype: torch.dtype  # the compute dtype (autocast); weights stay fp32
    rank: int
    comm: Comm
    timeout: timedelta  # of every collective
    tokenizer: Tokenizer
    backend: str  # the attention backend in effect, for the log
    data: tuple  # train (workers.with_workers), valid, test; None: an empty split
    parts: Parallelized  # this rank's model, pipeline, ZeRO and optimizer


def compute_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    """Dropout and sampling draw from these; initial weights have their own generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_run(cfg: Config, world: int) -> tuple[RunConfig, Tokenizer]:
    """The frozen run config for `world` ranks and the tokenizer that sets its vocabulary."""
    tokenizer = load_tokenizer(cfg)
    return resolve(cfg, world, tokenizer.vocab_size), tokenizer


def attention_backend(cfg: RunConfig, device: torch.device,
                      dtype: torch.dtype) -> tuple[str, Callable]:
    """--attention-backend for the model's mask on this device; ConfigError where it cannot
    run it. Under ring attention (cp > 1) the ring runs its own kernels whatever is chosen
    (rules.validate refuses other backends): a fused one for plain causal or full steps
    (model/attention/fused.py), the block kernel for masks."""
    m = cfg.model
    try:
        name, core = select_backend(m.attention_backend, device, dtype, mask_from_config(m),
                                    cfg.data.reset_attention_mask, m.attention_dropout)
    except ValueError as e:
        flag, rule = str(e).split(": ", 1)
        raise ConfigError(flag, rule) from None
    if cfg.dims.cp > 1:
        log.info("attention: ring over cp = %d: plain causal or full steps on a fused kernel, "
                 "masked steps on the block kernel%s", cfg.dims.cp,
                 ", every step with attention dropout (its positional mask)"
                 if m.attention_dropout else "")
        name = "ring"
    return name, core


def log_megatron_meanings(cfg: Config, run_cfg: RunConfig) -> None:
    """What Megatron-LM's values and habits mean here, said once."""
    if cfg.train.save_interval and not cfg.train.save:
        log.warning("--save-interval %d without --save: nothing is saved (as in Megatron-LM)",
                    cfg.train.save_interval)
    asked, runs = cfg.model.attention_backend, run_cfg.model.attention_backend
    if asked != runs:
        log.info("--attention-backend %s (Megatron-LM's) runs as %s here", asked, runs)
    if cfg.train.rampup_batch_size is not None and cfg.train.train_samples is None:
        log.info("--rampup-batch-size with --train-iters (Megatron-LM 000c4ac2 refuses the "
                 "pair, later versions and its GPT-3 175B example give both): %d steps whose "
                 "global batch ramps up, the learning rate counting iterations",
                 run_cfg.train.train_iters)
    if cfg.parallel.use_distributed_optimizer:
        log.info("--use-distributed-optimizer: %s", describe_dist_opt(run_cfg))
    for f in fields(CompatConfig):
        value = getattr(cfg.compat, f.name)
        if "flags" in f.metadata and value != f.default:
            flag = f.metadata["flags"][f.metadata["main"]]
            log.info("--%s%s: accepted, no effect here (%s)", f.name.replace("_", "-"),
                     "" if isinstance(value, bool) else f" {value}", flag.no_effect)
    for line in given_lines(cfg.compat.megatron_flags):
        log.info("%s", line)


def build_run(cfg: Config) -> Run:
    """Everything a training run needs, checked and built in order (module docstring)."""
    t = cfg.train
    seed_everything(t.seed)
    device = pick_device()
    # before the process group and the first matmul: NCCL and cuBLAS read it then
    log.info("%s", determinism.configure(t.deterministic, device))
    log.info("%s", precision.configure_tf32(device))  # before peak_tflops reads it
    dtype = compute_dtype(cfg)
    check_outputs(cfg)  # before anything is built: refusing is quick
    timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    # --zero-param-offload on one rank: FSDP2's units need a (world-1) group and mesh
    alone = cfg.parallel.zero_param_offload
    rank, world = init_distributed(device, timeout, alone)
    run_cfg, tokenizer = resolve_run(cfg, world)
    log.info("%s", format_settings(run_cfg))  # what the flags mean, before anything runs
    log_megatron_meanings(cfg, run_cfg)
    backend, core = attention_backend(run_cfg, device, dtype)
    log.info("%s", select_kernels(device).describe())  # apex probed here, once
    comm = Comm(build_mesh(run_cfg.dims, device.type, timeout) if world > 1 or alone
                else None)
    check_writable(run_cfg, comm)  # before any data, model or step: refusing is quick
    data = _build_data(run_cfg, rank, comm, tokenizer)
    with torch.device("meta"):
        model = GPT(run_cfg.model, core)
    from megaulysses.parallel.parallelize import parallelize
    parts = parallelize(model, comm, run_cfg, device, dtype,
                        lambda m: param_groups(m, t.weight_decay, t.decoupled_lr is not None),
                        lambda groups: adamw(groups, run_cfg.train))
    return Run(run_cfg, device, dtype, rank, comm, timeout, tokenizer, backend, data, parts)


def _build_data(cfg: RunConfig, rank: int, comm: Comm, tokenizer: Tokenizer
                ) -> tuple[Union[BatchBuilder, WorkerBatches], Optional[BatchBuilder],
                           Optional[BatchBuilder]]:
    """Rank 0 builds (and caches) the sample indices first; the others then load them."""
    if rank == 0:
        try:
            splits = build_datasets(cfg, tokenizer.vocab_size)
        finally:  # an error here is raised on every rank below: nobody waits forever
            comm.barrier()
    else:
        comm.barrier()
        splits = build_datasets(cfg, tokenizer.vocab_size)
    d, t, data = cfg.dims, cfg.train, cfg.data
    positions = None if d.seq_degree == 1 else local_positions(
        cfg.model.seq_length, d.cp, comm.rank(CP), d.sp, comm.rank(SP))

    gbs = filled(t.global_batch_size, "--global-batch-size")

    def builder(ds) -> Optional[BatchBuilder]:  # None: an empty split
        return None if ds is None else BatchBuilder(
            ds, t.micro_batch_size, gbs, dp_rank=comm.rank(DP), dp_size=d.dp,
            positions=positions, eod=tokenizer.eod, eod_mask_loss=data.eod_mask_loss,
            reset_position_ids=data.reset_position_ids,
            reset_attention_mask=data.reset_attention_mask,
            cyclic=data.dataloader_type == "cyclic", data_sharding=data.data_sharding)
    train, valid, test = (builder(ds) for ds in splits)
    assert train is not None, "build_datasets always builds the train split"
    return with_workers(train, data.num_workers), valid, test
