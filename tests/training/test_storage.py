"""Checkpoints on storage that fails them (issue 27), on real file systems: a small tmpfs
that fills during a save, and one remounted read-only. Each run is checked for the one
line a user sees, the exit code, what stays on disk, and the resume.

The disk fills mid-save through the `fill` fault (training/faults.py): at the save of an
iteration, after the run's own free-space check, a file grows until the tmpfs is full,
as another job's would; the checkpoint's writes then really fail with ENOSPC.

Mounting needs root (CAP_SYS_ADMIN); where the machine cannot mount, these tests are
skipped and say why (the retention and size rules below run everywhere).
"""

import contextlib
import glob
import os
import subprocess
import sys
import uuid

import pytest

from dist import run_ranks
from helpers import REPO, TINY

from megaulysses.config import BUNDLED_TOKENIZER, parse_args, resolve
from megaulysses.training.storage import Retention, checkpoint_bytes

BASE = TINY + ["--eval-iters", "0", "--train-iters", "4", "--log-interval", "2"]
RUN = BASE + ["--save-interval", "2"]
ZERO3 = ["--zero-stage", "3", "--global-batch-size", "8"]  # dp4: 1 micro-batch a rank
SIZE = checkpoint_bytes(resolve(parse_args(TINY), 1, 4096).model, BUNDLED_TOKENIZER)


def _mount_refusal():
    """None where this machine can mount a tmpfs, else why not."""
    if sys.platform != "linux":
        return "tmpfs mounts need Linux"
    probe = f"/tmp/megaulysses_mount_probe_{uuid.uuid4().hex[:8]}"
    os.makedirs(probe)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe],
                              capture_output=True, text=True)
        if done.returncode:
            return f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}"
        subprocess.run(["umount", probe], check=True)
    except FileNotFoundError:
        return "no mount command"
    finally:
        os.rmdir(probe)
    return None


REFUSAL = _mount_refusal()
mounts = pytest.mark.skipif(REFUSAL is not None, reason=str(REFUSAL))


@contextlib.contextmanager
def tmpfs(path, size: int, read_only: bool = False):
    """A tmpfs of `size` bytes at `path` (made), read-only if asked, unmounted after."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def cli(args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "pretrain_gpt.py", *args], cwd=REPO, timeout=300,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def main_rc(rank, world, args):
    import pretrain_gpt
    return pretrain_gpt.main(args)


def on_disk(ck: str) -> dict:
    """What a save directory holds: committed iterations, partial ones, the marker."""
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt")) as f:
        marker = f.read().strip()
    committed = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ck, "iter_*"))
                       if os.path.exists(os.path.join(p, "COMMITTED")))
    partial = glob.glob(os.path.join(ck, ".tmp_iter_*"))
    return {"marker": marker, "committed": committed, "partial": partial}


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# ---- the rules, everywhere ------------------------------------------------------------------

def test_retention_keeps_what_either_policy_keeps_and_never_the_latest_or_loaded():
    assert Retention().prunable([2, 4, 6]) == []
    assert Retention(keep_last=2).prunable([2, 4, 6, 8]) == [2, 4]
    # Megatron-LM's --save-retain-interval: multiples of N, and the latest
    assert Retention(retain_interval=4).prunable([2, 4, 6, 8, 10]) == [2, 6]
    assert Retention(keep_last=1, retain_interval=4).prunable([2, 4, 6, 8, 10]) == [2, 6]
    assert Retention(keep_last=1).prunable([2, 4, 6], protected=[2]) == [4]
    assert Retention(keep_last=1).prunable([2, 4, 6], protected=[None, 4]) == [2]


# ---- one process --------------------------------------------------------------------------

@mounts
@pytest.mark.parametrize("flag", ["--save", "--metrics-jsonl"])
def test_read_only_output_is_refused_before_any_step(tmp_path, flag):
    with tmpfs(tmp_path / "ro", 2 ** 20, read_only=True) as ro:
        target = os.path.join(ro, "ck") if flag == "--save" else os.path.join(ro, "m.jsonl")
        proc = cli(BASE + [flag, target, "--data-cache-path", str(tmp_path / "cache")])
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = error_line(proc)
    assert line.startswith(f"error: {flag}: cannot write to {ro}"), line
    assert "read-only file system" in line, line
    assert "iteration" not in proc.stdout  # no step ran


@mounts
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_mid_save_is_one_line_and_loses_nothing(tmp_path, async_save):
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    extra = ["--async-save"] if async_save else []
    with tmpfs(tmp_path / "small", 3 * SIZE) as fs:
        ck = os.path.join(fs, "ck")
        args = RUN + ["--save", ck, "--load", ck] + cache + extra
        proc = cli(args, {"MEGAULYSSES_FAULT": "fill:0:4"})
        assert proc.returncode == 1, proc.stderr[-3000:]
        line = error_line(proc)
        for words in ("saving iteration 4 to", "no space left on device", "one checkpoint is",
                      f"removed {ck}/.tmp_iter_0000004",
                      f"the last good checkpoint is {ck}/iter_0000002"):
            assert words in line, line
        assert on_disk(ck) == {"marker": "2", "committed": ["iter_0000002"], "partial": []}
        assert abs(du(os.path.join(ck, "iter_0000002")) - SIZE) < 0.03 * SIZE  # planned
        os.remove(os.path.join(ck, "fault_filler"))  # the other job's file goes
        os.makedirs(os.path.join(ck, ".tmp_iter_0000009"))  # a killed run's debris
        again = cli(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "removed " + os.path.join(ck, ".tmp_iter_0000009") in again.stdout
    assert "loaded checkpoint" in again.stdout and "iteration      4/" in again.stdout
    assert "iteration      2/" not in again.stdout  # resumed, not started again


@mounts
def test_too_little_space_stops_before_writing_unless_retention_makes_room(tmp_path):
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    with tmpfs(tmp_path / "a", int(1.6 * SIZE)) as fs:
        ck = os.path.join(fs, "ck")
        proc = cli(RUN + ["--save", ck] + cache)
        assert proc.returncode == 1, proc.stderr[-3000:]
        line = error_line(proc)
        for words in ("saving iteration 4 to", "not enough space", "nothing was written",
                      "--keep-last or --save-retain-interval",
                      f"the last good checkpoint is {ck}/iter_0000002"):
            assert words in line, line
        assert on_disk(ck) == {"marker": "2", "committed": ["iter_0000002"], "partial": []}
    with tmpfs(tmp_path / "b", int(2.6 * SIZE)) as fs:
        ck = os.path.join(fs, "ck")
        proc = cli(RUN + ["--save", ck, "--keep-last", "2", "--train-iters", "6"] + cache)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"--keep-last 2: removed {ck}/iter_0000002 (to make room)" in proc.stdout
        assert on_disk(ck) == {"marker": "6", "committed": ["iter_0000004", "iter_0000006"],
                               "partial": []}


# ---- 4 gloo ranks, ZeRO-3 (sharded checkpoints) --------------------------------------------

@mounts
def test_four_ranks_zero3_read_only_and_full_disk(tmp_path, monkeypatch):
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    with tmpfs(tmp_path / "ro", 2 ** 20, read_only=True) as ro:
        args = RUN + ZERO3 + ["--save", os.path.join(ro, "ck")] + cache
        assert run_ranks(main_rc, 4, args, timeout=120) == [2] * 4
    with tmpfs(tmp_path / "small", 3 * SIZE) as fs:
        ck = os.path.join(fs, "ck")
        args = RUN + ZERO3 + ["--save", ck, "--load", ck] + cache
        monkeypatch.setenv("MEGAULYSSES_FAULT", "fill:0:4")
        assert run_ranks(main_rc, 4, args, timeout=240) == [1] * 4  # every rank, no hang
        assert on_disk(ck) == {"marker": "2", "committed": ["iter_0000002"], "partial": []}
        monkeypatch.delenv("MEGAULYSSES_FAULT")
        os.remove(os.path.join(ck, "fault_filler"))
        assert run_ranks(main_rc, 4, args, timeout=240) == [0] * 4
        assert on_disk(ck) == {"marker": "4", "committed": ["iter_0000002", "iter_0000004"],
                               "partial": []}
