"""Run a function on N real gloo ranks (spawned processes on 127.0.0.1).

`run_ranks(fn, world, *args)` returns [fn(rank, world, *args) for each rank]. A rank that
raises fails the test with its traceback; a hang fails it after `timeout` seconds instead
of blocking CI. `fn` must be a module-level function (it is pickled by name) and should return plain
Python or numpy values: torch tensors would travel by shared memory that dies with the rank.

Ranks are forked from a forkserver that has imported torch and the trainer once (a
clean, single-threaded process that never computes): a spawned rank spent ~4 s of CPU
importing them, 32 s for an 8-rank grid on 2 cores, a third of the suite's time. Each
rank starts with the caller's environment as it is at `run_ranks` (a forked rank would
otherwise have the server's, from when it started).
"""

import os
import queue as queue_module
import random
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    """A free port for a rendezvous, below the kernel's ephemeral range. A port the kernel
    picks (bind to 0) is from that range, where any new connection may take it before the
    ranks bind it: under the suite's load a gloo connection of the other worker's grid did
    (EADDRINUSE in rank 0, rank 1 waiting on the store). Below it, only a process that asks
    for that port by number can, and the bind here checks that none has."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no luck below the range: the kernel's pick, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "numpy", "megaulysses.training.trainer"]


def _worker(rank, world, port, env, fn, args, queue):
    import torch
    import torch.distributed as dist
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)  # N ranks share 2 cores: oversubscription only slows them
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 300.0, daemon: bool = True):
    """`daemon` False: ranks that start processes of their own (megatron-core's checkpoint
    writer does); they are killed all the same when one fails or hangs."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world, port, env, fn, args, queue),
                         daemon=daemon)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break  # the others may now hang waiting for it
            results[rank] = value
    except queue_module.Empty:  # somebody hung
        errors.append(f"timeout after {timeout}s; finished ranks: {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
