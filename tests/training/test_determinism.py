"""Determinism: the same seed and grid give bit-identical losses and gradient norms, step
for step (== on floats, no tolerance), over 20 steps on CPU.

    one process        twice in this process, without and with dropout; a third time
                       under torch's deterministic mode (`determinism.configure`), which
                       also fills uninitialised memory with NaN: the same numbers again
                       show that no CPU op lacks a deterministic kernel and that nothing
                       reads memory it did not write
    tp2 x sp2 x dp2    ZeRO-3 on 8 gloo ranks: two Trainers one after the other in the
                       same spawn (everything rebuilt, seeds reset by the Trainer). One
                       spawn, not two: starting 8 processes on 2 cores costs 15-25 s.
                       (Two separate spawns, fresh processes and hash seeds, were also
                       bit-identical when this was written.)

None of this needs --deterministic: CPU kernels and gloo's reductions run in a fixed order
for a fixed grid, seed and thread count. What the flag switches on for CUDA, and what it
costs, is in docs/determinism.md. Across different grids bit-identity is not promised
(reduction orders differ): test_parity holds grids to fp32 tolerances instead.
"""

import contextlib
import os

import pytest
import torch

from dist import run_ranks
from helpers import TINY, read_jsonl, run_inprocess

STEPS = ["--train-iters", "20", "--eval-iters", "0"]  # later flags win over TINY's
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
# tp2 x sp2 x dp2 = 8 ranks: TINY's 4 heads and 2 kv groups split over tp x sp; one
# micro-batch of 1 sample per dp rank, the cheapest step the grid can run.
GRID = ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2",
        "--zero-stage", "3", "--micro-batch-size", "1", "--global-batch-size", "2"]


def curve(records) -> list[tuple]:
    """(iteration, loss, grad norm) of every training step (TINY logs each one)."""
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]


@pytest.fixture
def one_thread():
    """One intra-op thread, as each rank of run_ranks uses: both runs then split their
    reductions alike, and one thread is much faster than two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def deterministic_mode():
    """--deterministic's settings on CPU; torch's global mode as it was afterwards."""
    from megaulysses.training.determinism import configure
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        assert configure(True, torch.device("cpu")).startswith("deterministic: torch")
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@pytest.mark.parametrize("flags", [[], DROPOUT], ids=["no-dropout", "dropout"])
def test_one_process_is_bit_identical(tmp_path, one_thread, flags):
    first = curve(run_inprocess(STEPS + flags, tmp_path, "first"))
    assert [it for it, _, _ in first] == list(range(1, 21))
    assert curve(run_inprocess(STEPS + flags, tmp_path, "second")) == first
    with deterministic_mode():
        assert curve(run_inprocess(STEPS + flags, tmp_path, "third")) == first


def train_twice(rank, world, base_args, paths):
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    for path in paths:
        Trainer(parse_args(base_args + ["--metrics-jsonl", path])).train()


def test_tp2_sp2_dp2_zero3_is_bit_identical(tmp_path):
    base = TINY + STEPS + GRID + ["--data-cache-path", str(tmp_path / "cache")]
    paths = [str(tmp_path / "first.jsonl"), str(tmp_path / "second.jsonl")]
    run_ranks(train_twice, 8, base, paths)
    first, second = (curve(read_jsonl(p)) for p in paths)
    assert [it for it, _, _ in first] == list(range(1, 21))
    assert second == first


def test_configure_for_cuda(monkeypatch):
    """The CUDA settings, checked without a GPU: the environment variables cuBLAS and
    NCCL read, cuDNN's flags, and the start-up line; a variable already set is kept."""
    from megaulysses.training.determinism import configure
    for name in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO"):
        monkeypatch.setenv(name, "")  # recorded: the original comes back at the end
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    cuda = torch.device("cuda")
    assert configure(False, cuda).startswith("deterministic: off")
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # off: nothing set
    with deterministic_mode():  # restores torch's mode; cuDNN's flags restored below
        try:
            line = configure(True, cuda)
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        finally:
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["NCCL_ALGO"] == "Ring"
    assert line == ("deterministic: torch deterministic algorithms (ops without one raise), "
                    "cuBLAS workspace :4096:8, cuDNN deterministic, no benchmarking, "
                    "NCCL_ALGO Ring (from the environment)")
