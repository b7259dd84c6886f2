"""Which fused kernels a run uses (issue 43): decided once per device type by
`select_kernels`, named in the run's log (training/run.py).

    AdamW        torch's fused AdamW (one multi-tensor kernel per device and dtype) on
                 every device torch has one for (CUDA, CPU), else torch's foreach AdamW
                 (training/optim.py): never a per-parameter Python loop
    RMSNorm      on CUDA, apex's fused RMSNorm where apex and its CUDA extension import,
                 for fp32 inputs outside torch.compile; ours otherwise (norms.py)
    grad norm    torch._foreach_norm summing in fp64, unscaling and clipping by
                 torch._foreach_mul_, grouped by device and dtype (parallel/grad_norm.py)

apex's other kernels are left out on purpose, each for a contract it would break:
  - FusedAdam runs the multi-tensor Adam kernel torch's fused AdamW was ported from, but
    keeps one step count per parameter group, not per parameter: its state would not load
    a checkpoint of a run without apex, nor fit ZeRO's state materialization
    (parallel/zero.py), and its zero_grad takes no set_to_none.
  - amp_C.multi_tensor_l2norm sums squares in fp32; the global grad norm sums in fp64 so
    that every grid clips alike (grad_norm.py's `_global_norm`). multi_tensor_scale is the
    kernel _foreach_mul_ already runs on CUDA.
  - apex's norms write their output in the input's dtype for a 16-bit input (its "mixed
    dtypes" are an fp32 input with 16-bit weights): ours keep a 16-bit residual stream
    16-bit and return fp32 (norms.py), so apex serves fp32 inputs only. LayerNorm's
    F.layer_norm is one fused kernel on CUDA already.

apex installed but broken (its import fails, or its CUDA extension does not import): one
warning naming what failed, and ours is used. Off CUDA apex is not even imported.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

# (x, weight, normalized_shape, eps) -> y: apex's autograd function, fp32 in and out
FusedNorm = Callable[[torch.Tensor, torch.Tensor, tuple, float], torch.Tensor]


@dataclass(frozen=True)
class Kernels:
    """The kernels of one device type. `rms_norm`: apex's, or None (ours). `apex_problem`:
    why an installed apex is not used (None: it is, or it is not installed)."""

    device_type: str
    rms_norm: Optional[FusedNorm] = None
    apex_problem: Optional[str] = None

    def describe(self) -> str:
        """The log line."""
        norm = ("apex fused on fp32 inputs, ours on 16-bit ones and under torch.compile"
                if self.rms_norm is not None else "ours (model/ops/norms.py)")
        return (f"kernels ({self.device_type}): AdamW torch fused (foreach where the device "
                f"has none) | RMSNorm {norm} | grad norm, unscale, clip: torch foreach, norm "
                f"summed in fp64")


def select_kernels(device: torch.device) -> Kernels:
    """The kernels for `device`'s type: decided (apex probed, a broken one warned about)
    on the first call of the process for that type, the same afterwards."""
    return _selected(torch.device(device).type)


@functools.lru_cache(maxsize=None)
def _selected(device_type: str) -> Kernels:
    return decide(device_type)


def decide(device_type: str) -> Kernels:
    """`select_kernels` without the memo: probes apex again (tests)."""
    if device_type != "cuda":
        return Kernels(device_type)
    norm, problem = probe_apex()
    if problem is not None:
        log.warning("%s: torch's kernels and ours are used instead", problem)
    return Kernels(device_type, norm, problem)


def probe_apex() -> tuple[Optional[FusedNorm], Optional[str]]:
    """(apex's fused RMSNorm, None) where apex and its CUDA extension import; (None, None)
    where apex is not installed; (None, what failed) where it is installed but broken."""
    try:
        import apex  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "apex":
            return None, None
        return None, _failed("apex", e)
    except Exception as e:  # a broken install can raise anything while importing
        return None, _failed("apex", e)
    try:
        # apex's CUDA extension (built with --cuda_ext); its Python imports it lazily, at
        # the first forward: import it now to know
        import fused_layer_norm_cuda  # noqa: F401
        from apex.normalization.fused_layer_norm import FusedRMSNormAffineFunction
    except Exception as e:
        return None, _failed("apex's fused_layer_norm_cuda extension", e)
    return FusedRMSNormAffineFunction.apply, None  # not the function form: it autocasts


def _failed(what: str, e: BaseException) -> str:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"apex is installed but {what} does not import ({type(e).__name__}: {first})"
