import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the machine's 2 cores: one torch thread each (and in what they
    # start). Two threads per worker spin-wait in OpenMP on the core the other worker
    # holds, which made in-process runs 10-30x slower under load.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(TESTS), TESTS):  # the checkout, and tests/helpers.py
    if path not in sys.path:
        sys.path.insert(0, path)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        torch.set_num_threads(1)  # in case torch was imported before this file


# tests/slurm first: its jobs spend much of their time waiting on the scheduler (a
# requeue's restart, a lost node's detection), which the other worker's files fill when
# it starts at once; last, it kept one worker alone for minutes at the suite's end.
# xdist (--dist loadfile) hands out whole files in collection order.
FIRST = ("tests/slurm/",)


def pytest_collection_modifyitems(config, items):
    first = lambda item: not any(p in item.nodeid for p in FIRST)  # noqa: E731
    items.sort(key=first)  # stable: every file stays whole and in order
