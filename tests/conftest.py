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


# Files in the order xdist (--dist loadfile, --no-loadscope-reorder) hands them out: the
# heaviest first, so that the suite does not end on one worker running a long file alone
# (xdist's default order, by count of tests, put the long few-test files last: the
# default run, the convergence study). Seconds per file on 2 cores under the suite's own
# load (`--durations=0`, 2026-12-07); the other files follow, those with more tests first.
# tests/slurm leads: its jobs wait on the scheduler (a requeue, a lost node's detection),
# which the other worker fills.
HEAVY = ["tests/slurm/test_slurm_cluster.py",  # 240
         "tests/benchmarks/test_long_context_frontier.py",  # 146
         "tests/parallel/test_zero.py",  # 105
         "tests/parallel/test_compile.py",  # 101
         "tests/training/test_faults.py",  # 99
         "tests/parallel/test_memory_plan.py",  # 98
         "tests/test_guides.py",  # 96
         "tests/parallel/test_pipeline.py",  # 83
         "tests/test_default_run.py",  # 81
         "tests/parallel/test_attention_masks.py",  # 75
         "tests/test_invalid_flags.py",  # 59
         "tests/parallel/test_dist_opt.py",  # 55
         "tests/tools/test_plan.py",  # 54
         "tests/parallel/test_dtype_matrix.py",  # 50
         "tests/benchmarks/test_long_sequence.py",  # 45
         "tests/examples/test_extend_context.py",  # 44
         "tests/parallel/test_parity.py",  # 42
         "tests/training/test_preemption.py",  # 37
         "tests/parallel/test_pipeline_buffers.py",  # 35
         "tests/test_convergence.py",  # 34
         "tests/training/test_storage.py",  # 34
         "tests/examples/test_paper_scripts.py",  # 32
         "tests/benchmarks/test_device_check.py",  # 31
         "tests/parallel/test_grid_errors.py",  # 30
         "tests/training/test_clean_exit.py"]  # 25


def pytest_collection_modifyitems(config, items):
    path = lambda item: item.nodeid.split("::")[0]  # noqa: E731
    count: dict = {}
    for item in items:
        count[path(item)] = count.get(path(item), 0) + 1

    def order(item):
        p = path(item)
        return (HEAVY.index(p) if p in HEAVY else len(HEAVY), -count[p], p)
    items.sort(key=order)  # stable: every file stays whole and in order
