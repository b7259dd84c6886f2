"""What the benchmark scripts share.

`launch(fn, P, *args, timeout=...)` runs `fn(rank, P, *args)` on P spawned gloo ranks
(127.0.0.1, one torch thread each) and returns the results in rank order. `fn` must be a
module-level function of the script (spawn pickles it by name) and return plain Python
values. A rank that fails raises here with its traceback; a hang raises after `timeout`
seconds. `preload=[module, ...]`: the ranks are forked from a forkserver that imported
those once (spawned ranks import everything each, seconds per rank). `table(header,
rows)` formats a Markdown table.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, P, port, fn, args, out_queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(P), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=P)
        out_queue.put((rank, "ok", fn(rank, P, *args)))
    except BaseException:
        out_queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(fn, P: int, *args, timeout: float = 3600.0, preload: list | None = None) -> list:
    ctx = mp.get_context("forkserver" if preload else "spawn")
    if preload:
        ctx.set_forkserver_preload(preload)  # read when the server starts (the first call)
    out_queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, P, port, fn, args, out_queue), daemon=True)
             for r in range(P)]
    for proc in procs:
        proc.start()
    results = {}
    try:
        for _ in range(P):
            rank, status, value = out_queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"P={P} rank {rank} failed:\n{value}")
            results[rank] = value
    except queue_module.Empty:
        raise RuntimeError(f"P={P}: no result after {timeout} s") from None
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(results) == P else 0.1)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(P)]


def max_per_kind(dicts) -> dict:
    """{kind: the largest count of that kind} over ranks' byte dicts (the busiest rank)."""
    out = {}
    for d in dicts:
        for kind, n in d.items():
            out[kind] = max(out.get(kind, 0), n)
    return out


def table(header, rows) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in cells[1:]])
