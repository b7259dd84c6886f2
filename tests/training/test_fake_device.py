"""Real Trainer runs on a fake accelerator (issue 22): a forgotten `device=` fails in CI.

On the CPU a tensor made without `device=` lands where the model is, so every CPU test
passes and the run fails only on a GPU. Here the trainer's device is "fakeaccel"
(`megaulysses/training/fake_device.py`: a Python-only PrivateUse1 device, every tensor a
FakeTensor, this process one rank of the grid on torch's fake process group): an op that
meets a fakeaccel tensor and a CPU one raises `FakeTensorDeviceMismatchError`, as CUDA
would, and a collective on a CPU tensor raises, as NCCL would.

Each grid runs the real `Trainer.train()` for 2 iterations (forward, backward, gradient
reduction, clipping, AdamW: the first step creates the optimizer states, the second uses
them) and one validation and one test evaluation, and must end with every parameter,
buffer and optimizer state on fakeaccel and AdamW stepped twice. Multi-rank grids run one
or two of their ranks (pipeline stages differ; tp/sp/dp ranks run the same code). One
run with a device bug put in (the loss mask left on the CPU) must fail with the mismatch.

Every grid runs in one spawned process: the device's name is that process's one
PrivateUse1 backend for good (torch allows one per process), which pytest's own process
should not get, and one start-up of torch serves every grid.

Masked models, and attention dropout, use `--attention-backend math`: the CPU block
kernel plans its blocks from the mask's values (`nonzero`), which fake tensors do not have; the ring (cp) uses it too,
so context parallelism is not run here. What else the fake device cannot show is listed
in fake_device.py.
"""

import contextlib
import logging
import multiprocessing
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor

import pytest

from helpers import TINY

STEPS = 2
# --num-workers 0: data loader workers would be forked inside the fake mode (their
# batches are CPU tensors made the same way either way)
BASE = TINY + ["--num-layers", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "511", "--train-iters", str(STEPS), "--eval-interval",
               str(STEPS), "--eval-iters", "1", "--num-workers", "0"]
SP2 = ["--ds-sequence-parallel-size", "2"]
MEGATRON_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
GPT2 = ["--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm",
        "--add-bias-linear", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1",
        # attention dropout: `auto` picks the block kernel (its positional mask), which plans
        # from values as for masks (below); math draws the same mask densely, on the device
        "--attention-backend", "math"]
MASKS = ["--attention-backend", "math", "--window-size", "8", "--reset-attention-mask",
         "--reset-position-ids"]
NORMS = ["--log-params-norm", "--log-num-zeros-in-grad"]  # their sums run on the device too
GRIDS = {  # name: (world, the ranks run, flags); 1 layer (2 with pp)
    "1 process": (1, [0], []),
    "1 process, bf16, selective recompute, GPT-2 style": (1, [0], [
        "--bf16", "--recompute-activations"] + GPT2),
    "tp2 + Megatron-SP + ZeRO-1, MLP tiled 2": (2, [1], MEGATRON_SP + [
        "--zero-stage", "1", "--tiled-mlp-chunks", "2"]),
    "sp2 (Ulysses), full recompute, fp16 loss scaling": (2, [1], SP2 + [
        "--recompute-granularity", "full", "--fp16"]),
    "sp2, window + packed documents": (2, [1], SP2 + MASKS),
    "sp2, activation offload + head groups": (2, [1], SP2 + [
        "--recompute-granularity", "full", "--cpu-offloading-num-layers", "1",
        "--attention-head-groups", "2", "--bf16"]),
    "FSDP2: dp2, ZeRO-3": (2, [1], ["--zero-stage", "3"]),
    "FSDP2 over tp2 x dp2: ZeRO-3 + Megatron-SP, selective": (4, [3], MEGATRON_SP + [
        "--zero-stage", "3", "--recompute-activations"] + NORMS),
    "pp2, 1f1b": (2, [0, 1], ["--pipeline-model-parallel-size", "2", "--num-layers", "2"]
                  + NORMS),
}


# -- in the spawned process ---------------------------------------------------------------

def train_all(grids: dict) -> dict:
    """{(grid, rank): what `train_rank` returned, or the traceback of its error}."""
    _quiet()
    out = {}
    for name, (world, ranks, flags) in grids.items():
        for rank in ranks:
            try:
                out[name, rank] = train_rank(world, rank, flags)
            except Exception:
                out[name, rank] = traceback.format_exc()
    return out


def train_rank(world: int, rank: int, flags: list, bug=contextlib.nullcontext) -> dict:
    """The real Trainer as rank `rank` of `world` on the fake accelerator, trained."""
    from megaulysses.config import parse_args
    from megaulysses.training import fake_device
    from megaulysses.training.trainer import Trainer
    with fake_device.fake_rank(rank, world), bug():
        trainer = Trainer(parse_args(BASE + flags))
        steps = []
        trainer.optimizer.register_step_post_hook(lambda *_: steps.append(1))
        result = trainer.train()
        states = list(trainer.optimizer.state.values())
        held = [*trainer.model.parameters(), *trainer.model.buffers(),
                *(v for s in states for k, v in s.items() if k != "step")]  # CPU unless fused
        return {"iteration": result["iteration"], "stopped": result["stopped"],
                "skipped": trainer.state.skipped_iterations, "optimizer_steps": len(steps),
                "states": len(states), "devices": sorted({_local(t).device.type for t in held})}


def train_with_loss_mask_on_cpu() -> str:
    """A device bug: the loss mask is not moved to the device (it passes on the CPU)."""
    _quiet()
    try:
        train_rank(1, 0, [], bug=_loss_mask_left_on_cpu)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@contextlib.contextmanager
def _loss_mask_left_on_cpu():
    from megaulysses.training import step
    on = step._on
    step._on = lambda b, device: {**on(b, device), "loss_mask": b["loss_mask"]}
    try:
        yield
    finally:
        step._on = on


def _local(t):
    return getattr(t, "_local_tensor", t)  # a DTensor's shard


def _quiet():
    logging.disable(logging.INFO)
    warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")


# -- the tests -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker():
    """One spawned process for every run (see the module doc)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.fixture(scope="module")
def results(worker):
    return worker.submit(train_all, GRIDS).result(timeout=600)


@pytest.mark.parametrize("name,rank", [(name, rank) for name, (_, ranks, _) in GRIDS.items()
                                       for rank in ranks])
def test_grid_trains_on_the_fake_accelerator(results, name, rank):
    r = results[name, rank]
    assert isinstance(r, dict), f"{name}, rank {rank}:\n{r}"
    assert (r["iteration"], r["stopped"], r["skipped"]) == (STEPS, None, 0), r
    assert r["optimizer_steps"] == STEPS and r["states"] > 0, r
    assert r["devices"] == ["fakeaccel"], r  # parameters, buffers, optimizer states


def test_a_tensor_left_on_the_cpu_fails_the_step(worker):
    error = worker.submit(train_with_loss_mask_on_cpu).result(timeout=300)
    assert error.startswith("FakeTensorDeviceMismatchError"), error
    assert "fakeaccel" in error and "cpu" in error, error
