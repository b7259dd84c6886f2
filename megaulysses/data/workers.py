"""--num-workers: the training batches built ahead of the steps by worker processes
(Megatron-LM's data loader workers).

`BatchBuilder.micro_batches(consumed)` is a pure function of the consumed-sample count, so
a worker computes exactly what the training process would: the i-th global batch ahead is
`micro_batches(start + i * global batch size)`. A torch DataLoader runs them: N forked
processes, each building every N-th batch, `prefetch_factor` batches each ahead, handed
back in order. Asked for another position than the next one (the first step, the first
after loading a checkpoint) it starts again from there, so resuming is exact and nothing
about the workers is saved. A worker's failure is not trusted to tell its own story: the
batch is built again here, where an error is raised as itself, and the run goes on
without workers.

Workers are forked (the dataset's memory maps are shared, nothing is pickled, start-up
costs milliseconds). A daemonic process may not start any (multiprocessing's rule: a rank
started by a test harness, say): it builds the batches itself. The training process
decides how to stop (a scheduler may signal the whole process group): its workers end
with it (close(), or they see it gone), or quietly on SIGTERM (`_on_stop_signals`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from typing import Iterator, Optional, Union

import torch.utils.data

from megaulysses.data.loader import BatchBuilder

log = logging.getLogger(__name__)


def with_workers(builder: BatchBuilder, num_workers: int) -> Union[BatchBuilder, WorkerBatches]:
    """`builder`'s training batches, built by `num_workers` processes (0: by this one)."""
    if num_workers == 0:
        return builder
    if multiprocessing.current_process().daemon:
        log.info("--num-workers %d: this process is daemonic and may not start worker "
                 "processes: it builds the batches itself (the same batches)", num_workers)
        return builder
    return WorkerBatches(builder, num_workers)


class _GlobalBatches(torch.utils.data.Dataset):
    """Item `consumed`: this rank's micro-batches of the global batch starting there."""

    def __init__(self, builder: BatchBuilder):
        self.builder = builder

    def __getitem__(self, consumed: int) -> list[dict]:
        return self.builder.micro_batches(consumed)


def _as_is(item):
    return item


def _on_stop_signals(worker_id: int) -> None:
    """A worker leaves stopping to the training process: SIGUSR1 and SIGINT are ignored;
    SIGTERM (also what the DataLoader sends a worker that does not stop) ends it with
    exit code 0, which the training process's DataLoader does not take for a failure (a
    worker killed by the signal would raise in the middle of a save on preemption)."""
    for sig in (signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))


def _positions(start: int, step: int) -> Iterator[int]:
    while True:
        yield start
        start += step


class WorkerBatches:
    """BatchBuilder's `micro_batches` for training, built ahead by worker processes.
    `close()` stops them (they also stop with this object, or this process)."""

    def __init__(self, builder: BatchBuilder, num_workers: int):
        self.builder, self.gbs, self.num_workers = builder, builder.gbs, num_workers
        self._batches: Optional[Iterator[list[dict]]] = None
        self._next: Optional[int] = None  # the consumed-sample count _batches yields next
        self._failed = False

    def micro_batches(self, consumed_samples: int,
                      global_batch: Optional[int] = None) -> list[dict]:
        """This rank's micro-batches of the global batch starting at `consumed_samples`
        (`global_batch`: a --rampup-batch-size batch, built here: the workers build
        full-size ones)."""
        if self._failed or (global_batch or self.gbs) != self.gbs:
            return self.builder.micro_batches(consumed_samples, global_batch)
        if consumed_samples != self._next:
            self._start(consumed_samples)
        # close() sets both to None, _start the iterator: a None here is a bug
        assert self._batches is not None
        try:
            batches = next(self._batches)
        except Exception as e:  # a worker raised or is gone: build it here instead
            # a worker's error arrives as "Caught X in DataLoader worker ...", its
            # traceback, and last "X: what happened"
            failure = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        else:
            self._next = consumed_samples + self.gbs
            return batches
        log.warning("--num-workers: a data loader worker failed (%s); building the batches "
                    "in the training process from here on", failure)
        self._failed = True
        self.close()
        return self.builder.micro_batches(consumed_samples)

    def _start(self, consumed_samples: int) -> None:
        self.close()
        methods = multiprocessing.get_all_start_methods()
        loader = torch.utils.data.DataLoader(
            _GlobalBatches(self.builder), batch_size=None,
            sampler=_positions(consumed_samples, self.gbs), num_workers=self.num_workers,
            collate_fn=_as_is, worker_init_fn=_on_stop_signals,
            # its own generator: the workers' seeds must not draw from the global RNG,
            # whose stream (dropout) a checkpoint restores
            generator=torch.Generator(),
            multiprocessing_context="fork" if "fork" in methods else None)
        self._batches = iter(loader)
        log.info("--num-workers %d: worker processes build the training batches from "
                 "sample %d on", self.num_workers, consumed_samples)

    def close(self) -> None:
        """Stop the workers and join them, now; the next `micro_batches` starts new ones."""
        batches, self._batches, self._next = self._batches, None, None
        # What the DataLoader iterator's finalizer runs, called here: after a worker's
        # error, the exception's traceback keeps the iterator alive, in a reference cycle.
        stop = getattr(batches, "_shutdown_workers", None)
        if stop is not None:
            stop()
