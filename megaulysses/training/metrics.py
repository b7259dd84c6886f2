"""Throughput, FLOPs, MFU, memory, and where metrics go (tensorboard, JSON lines, wandb)."""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import time
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from megaulysses.model.flops import flops_per_iteration  # noqa: F401 (re-exported)
from megaulysses.model.ops import linear
from megaulysses.training.precision import tf32_active
from megaulysses.training.wandb_writer import WandbWriter, open_wandb

if TYPE_CHECKING:
    from megaulysses.config import RunConfig

log = logging.getLogger(__name__)

# The scalars tensorboard and wandb get each --tensorboard-log-interval, as that
# iteration's values (report.IterationScalars, and its time_*_s timers); a log record's
# (window means) go to --metrics-jsonl and the log line only. Megatron-LM's split.
PER_ITERATION_SCALARS = frozenset({
    "loss", "lr", "decoupled_lr", "global_batch_size", "grad_norm", "params_norm",
    "num_zeros", "loss_scale", "step_time_s"})


class GpuPeak(NamedTuple):
    """Dense (no 2:4 sparsity) peak TFLOP/s of one GPU, from NVIDIA's data sheets."""
    half: float  # bf16/fp16 inputs on tensor cores (V100: fp16 only)
    tf32: float  # fp32 inputs on TF32 tensor cores (no TF32 before Ampere: = fp32)
    fp32: float  # IEEE fp32 on CUDA cores


# Keyed by the tokens (upper case, split at anything not a letter or digit) that must all
# be in torch.cuda.get_device_name(); the entry with the most tokens wins, so a PCIe or
# NVL part gets its own figures and "L4" never matches "L40" or "L40S".
GPU_PEAKS: dict[tuple[str, ...], GpuPeak] = {
    ("B200",): GpuPeak(2250.0, 1100.0, 75.0),  # HGX B200, per GPU
    ("GH200",): GpuPeak(989.4, 494.7, 66.9),
    ("H200",): GpuPeak(989.4, 494.7, 66.9),  # SXM
    ("H200", "NVL"): GpuPeak(835.5, 417.5, 60.0),
    ("H100",): GpuPeak(989.4, 494.7, 66.9),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H100", "PCIE"): GpuPeak(756.5, 378.0, 51.2),
    ("H100", "NVL"): GpuPeak(835.5, 417.5, 60.0),
    ("A100",): GpuPeak(312.0, 156.0, 19.5),  # SXM4 and PCIe alike
    ("A40",): GpuPeak(149.7, 74.8, 37.4),
    ("A10",): GpuPeak(125.0, 62.5, 31.2),
    ("L40S",): GpuPeak(362.05, 183.0, 91.6),
    ("L40",): GpuPeak(181.05, 90.5, 90.5),
    ("L4",): GpuPeak(121.0, 60.0, 30.3),
    ("V100",): GpuPeak(125.0, 15.7, 15.7),  # SXM2
    ("V100", "PCIE"): GpuPeak(112.0, 14.0, 14.0),
}


def gpu_peak(name: str) -> Optional[tuple[tuple[str, ...], GpuPeak]]:
    """(key, peaks) of GPU_PEAKS' most specific entry for a device name, or None."""
    tokens = set(re.split(r"[^A-Z0-9]+", name.upper()))
    hits = [(key, peak) for key, peak in GPU_PEAKS.items() if set(key) <= tokens]
    return max(hits, key=lambda hit: len(hit[0]), default=None)


def gpu_peak_tflops(name: str, dtype: torch.dtype, tf32: bool) -> Optional[float]:
    """The table's peak for this GPU and compute dtype (fp32: TF32's when `tf32`), or None
    for a GPU it does not know."""
    hit = gpu_peak(name)
    if hit is None:
        return None
    peak = hit[1]
    if dtype in (torch.bfloat16, torch.float16):
        return peak.half
    return peak.tf32 if tf32 else peak.fp32


def measure_cpu_peak_tflops(dtype: torch.dtype = torch.float32) -> float:
    """A CPU has no spec sheet here: time square matmuls, the best of a few runs.

    Starts small: where a dtype is emulated (fp16 on most CPUs: ~2 GFLOP/s) a 1024 matmul
    would take seconds, and the small size already measures that slow path well.
    """
    peak = _best_matmul_rate(dtype, 256)
    return peak if peak < 0.05 else max(peak, _best_matmul_rate(dtype, 1024))


def _best_matmul_rate(dtype: torch.dtype, n: int) -> float:
    g = torch.Generator().manual_seed(0)  # never the global RNG: resumes must not shift it
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    # The model's own matmul path (oneDNN for fp32 on CPU): the peak of what it can reach.
    linear(a, b)  # warm-up (thread pool, kernel selection)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(4):
            linear(a, b)
        best = min(best, (time.perf_counter() - t) / 4)
    return 2 * n ** 3 / best / 1e12


def peak_tflops(device: torch.device, dtype: torch.dtype, override: Optional[float],
                name: Optional[str] = None, tf32: Optional[bool] = None) -> float:
    """The per-device peak MFU divides by: `override` (--peak-tflops); on CUDA the table
    for `name` (default: the device's), fp32 at the TF32 peak where fp32 matmuls run in
    TF32 (`tf32`, default: precision.tf32_active()), else a timed matmul."""
    if override:
        return override
    if device.type == "cuda":
        name = name or torch.cuda.get_device_name(device)
        tf32 = tf32_active() if tf32 is None else tf32
        peak = gpu_peak_tflops(name, dtype, tf32)
        if peak is not None:
            kind = "bf16/fp16" if dtype in (torch.bfloat16, torch.float16) else \
                ("TF32" if tf32 else "fp32 (no TF32)")
            hit = gpu_peak(name)
            assert hit is not None, "gpu_peak_tflops found it"
            log.info("peak for MFU: %s -> GPU_PEAKS[%s] %s %.1f TFLOP/s", name,
                     " ".join(hit[0]), kind, peak)
            return peak
        log.warning("unknown GPU %r: pass --peak-tflops for MFU; measuring a matmul", name)
    return measure_cpu_peak_tflops(dtype) if device.type == "cpu" else _measure_cuda(dtype)


def _measure_cuda(dtype):
    a = torch.ones(8192, 8192, dtype=dtype, device="cuda")
    a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 10 / (time.perf_counter() - t) / 1e12


def memory_stats(device: torch.device) -> dict:
    """GiB: CUDA allocator figures on GPU; on CPU the process's resident set now and its
    peak (the kernel's high-water mark, VmHWM), which includes everything the process holds."""
    if device.type == "cuda":
        return {"mem_allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
                "mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    rss = _proc_status_kib("VmRSS")
    peak = _proc_status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mem_rss_gib": rss / 2**20, "mem_peak_gib": peak / 2**20}


def _proc_status_kib(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


class MetricsWriter:
    """Writes each logged record to tensorboard, --metrics-jsonl and wandb (rank 0 only)."""

    def __init__(self, tensorboard_dir: Optional[str], jsonl_path: Optional[str],
                 resumed_at: Optional[int] = None, enabled: bool = True,
                 wandb: Optional[WandbWriter] = None):
        """`resumed_at`: the iteration a resumed run continues from. Its files continue,
        minus what an interrupted run logged after that iteration (it is logged again);
        a fresh run (None) starts them anew. `wandb`: --wandb-project's run."""
        self.tb = self.jsonl = None
        self.wandb = wandb if enabled else None
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: tensorboard drops the events at or after it from older files
            self.tb = SummaryWriter(log_dir=tensorboard_dir, purge_step=None if resumed_at
                                    is None else resumed_at + 1)
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            if resumed_at is not None:
                _truncate_jsonl(jsonl_path, resumed_at)
            self.jsonl = open(jsonl_path, "a" if resumed_at is not None else "w")

    @classmethod
    def for_run(cls, cfg: RunConfig, rank: int,
                resumed_at: Optional[int] = None) -> "MetricsWriter":
        """The run's sinks on rank 0 (its loss and norms are global); none elsewhere."""
        wandb = open_wandb(cfg) if rank == 0 else None
        return cls(cfg.log.tensorboard_dir, cfg.log.metrics_jsonl, resumed_at, rank == 0, wandb)

    def write(self, record: dict) -> None:
        """A log or evaluation record (it has an `iteration`): --metrics-jsonl gets all of
        it; tensorboard and wandb each numeric entry but PER_ITERATION_SCALARS (those are
        `scalars`' to write)."""
        self._scalars({k: v for k, v in record.items() if k not in PER_ITERATION_SCALARS},
                      record["iteration"])
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

    def scalars(self, record: Optional[dict]) -> None:
        """One iteration's scalars (report.IterationScalars), to tensorboard and wandb
        only; None: nothing this iteration."""
        if record is not None:
            self._scalars(record, record["iteration"])

    def _scalars(self, record: dict, step: int) -> None:
        values = {k: v for k, v in record.items()
                  if k != "iteration" and isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None and values:
            self.wandb.log(values, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.close()


def _truncate_jsonl(path: str, last_iteration: int):
    """Keep the records up to `last_iteration` (atomically: write a copy, rename)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = [line for line in lines if _iteration(line) <= last_iteration]
    if len(keep) == len(lines):
        return
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def _iteration(line: str) -> float:
    try:
        return json.loads(line).get("iteration", 0)
    except ValueError:  # a line cut short by the crash
        return float("inf")
