"""--num-workers: the training batches are built by worker processes, the same batches as
without them; a run stopped and resumed with workers trains like one unbroken run without
them, and leaves no process behind."""

import logging
import multiprocessing
import os

import numpy as np
import torch

from helpers import run_inprocess, train_losses

# dropout on: starting the workers must not draw from the RNG that a checkpoint restores
NO_EVAL = ["--eval-iters", "0", "--train-iters", "4", "--hidden-dropout", "0.1"]


class PidSamples:
    """Samples whose tokens say which process read them (the pid) and which sample they
    are: sample i is [i, pid, i, pid, ...]."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return np.array([i, os.getpid()] * 5, dtype=np.int64)


def test_workers_build_the_same_batches_in_other_processes():
    from megaulysses.data.loader import BatchBuilder
    from megaulysses.data.workers import WorkerBatches, with_workers
    builder = BatchBuilder(PidSamples(), micro_batch_size=2, global_batch_size=4)
    assert with_workers(builder, 0) is builder
    workers = with_workers(builder, 2)
    assert isinstance(workers, WorkerBatches)
    pids = set()
    for consumed in (0, 4, 8, 40, 44, 12):  # in order, then elsewhere (a restart), back
        got, want = workers.micro_batches(consumed), builder.micro_batches(consumed)
        assert len(got) == len(want) == 2
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g["tokens"][:, 0::2], w["tokens"][:, 0::2])  # sample ids
            assert torch.equal(g["labels"][:, 1::2], w["labels"][:, 1::2])
            pids |= set(g["tokens"][:, 1].tolist())
    assert os.getpid() not in pids and len(pids) >= 2  # workers built them (new ones
    # after each restart)
    assert len(multiprocessing.active_children()) == 2
    workers.close()
    assert multiprocessing.active_children() == []


def test_resumed_with_workers_equals_unbroken_without(tmp_path, caplog):
    """Stopped at 2 (--exit-interval) and resumed to 4 with two workers: the losses of the
    unbroken run without workers, bit for bit; no worker outlives its run."""
    caplog.set_level(logging.INFO, logger="megaulysses.data.workers")
    full = train_losses(run_inprocess(NO_EVAL + ["--num-workers", "0"], tmp_path, "full"))
    ck = str(tmp_path / "ck")
    workers = ["--num-workers", "2"]
    first = run_inprocess(NO_EVAL + workers + ["--save", ck, "--exit-interval", "2"], tmp_path,
                          "first")
    assert multiprocessing.active_children() == []
    second = run_inprocess(NO_EVAL + workers + ["--load", ck], tmp_path, "second")
    assert multiprocessing.active_children() == []
    starts = [r.getMessage() for r in caplog.records if "worker processes build" in r.getMessage()]
    assert [m.rsplit(" ", 2)[1] for m in starts] == ["0", "8"]  # each run, where it began
    resumed = {**train_losses(first), **train_losses(second)}
    assert sorted(train_losses(second)) == [3, 4]
    assert resumed == full


class FailsInWorkers(PidSamples):
    """Reading fails in any process but the one that made it."""

    def __init__(self):
        self.owner = os.getpid()

    def __getitem__(self, i):
        if os.getpid() != self.owner:
            raise OSError("disk gone")
        return super().__getitem__(i)


def test_a_failing_worker_is_replaced_by_this_process(caplog):
    """The batch is built here (where a real error would be raised as itself), with one
    warning, and the run goes on without workers."""
    from megaulysses.data.loader import BatchBuilder
    from megaulysses.data.workers import with_workers
    builder = BatchBuilder(FailsInWorkers(), micro_batch_size=2, global_batch_size=4)
    workers = with_workers(builder, 2)
    for consumed in (0, 4):
        got = workers.micro_batches(consumed)
        assert torch.equal(got[0]["tokens"], builder.micro_batches(consumed)[0]["tokens"])
    assert multiprocessing.active_children() == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "disk gone" in warnings[0], warnings
