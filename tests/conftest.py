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


# The longest files (seconds each on 2 cores, under two workers), run first: xdist hands
# out whole files in collection order, and one of these last kept one worker alone for
# ~5 minutes at the end of the suite.
LONGEST_FIRST = ("test_attention_masks.py", "test_memory_plan.py", "test_default_run.py",
                 "test_compile.py", "test_long_sequence.py", "test_plan.py", "test_faults.py",
                 "test_zero.py", "test_convergence.py", "test_dtype_matrix.py",
                 "test_extend_context.py", "test_pipeline.py")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: files stay whole
