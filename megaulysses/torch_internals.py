"""Every private part of torch this framework builds on, in one list, checked at start-up.

CI tests one torch: `TESTED` (pyproject.toml allows the range below it, untested). Where
another torch renamed or reshaped one of these, `check()` says so in one line naming the
torch version and the part, before any step, instead of an AttributeError or TypeError
in the middle of one. Each entry names what uses it; a new use of a private torch name
goes here too (tests/test_torch_internals.py holds the list to the code). Importing this
module does not import torch.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

TESTED = "2.13"


class TorchInternalsError(RuntimeError):
    """A private part of torch is missing or changed: one line for users."""


@dataclass(frozen=True)
class Internal:
    name: str  # module:attribute (attribute may be dotted)
    used_by: str  # the modules that rely on it
    expect: tuple = ()  # parameter names its callable must take (a changed signature)
    startup: bool = True  # checked at every start (else: the fake devices' alone)


def _pipeline_methods() -> list[Internal]:
    """PipelineStage's hooks parallel/pipeline.py overrides, with the arguments it passes."""
    stage = "torch.distributed.pipelining:PipelineStage."
    return [Internal(stage + "_setup_forward_recv_info", "parallel/pipeline.py",
                     ("num_microbatches", "has_backward")),
            Internal(stage + "_create_grad_recv_info", "parallel/pipeline.py",
                     ("act_send_info",)),
            *(Internal(stage + m, "parallel/pipeline.py", ("fwd_chunk_id",)) for m in
              ("get_fwd_recv_ops", "get_fwd_send_ops", "forward_one_chunk")),
            *(Internal(stage + m, "parallel/pipeline.py", ("bwd_chunk_id",)) for m in
              ("get_bwd_recv_ops", "get_bwd_send_ops", "backward_one_chunk",
               "backward_weight_one_chunk"))]


INTERNALS: list[Internal] = [
    *_pipeline_methods(),
    Internal("torch.distributed.pipelining._utils:_make_tensor_from_meta",
             "parallel/pipeline.py"),
    Internal("torch.distributed.pipelining.stage:_RecvInfo", "parallel/pipeline.py"),
    Internal("torch.distributed.pipelining.schedules:_Action", "parallel/pipeline_sends.py"),
    Internal("torch.distributed.tensor.placement_types:_StridedShard",
             "parallel/parallelize.py, parallel/zero.py"),
    Internal("torch.distributed.fsdp._fully_shard._fsdp_api:AllGather",
             "parallel/zero_units.py"),
    Internal("torch.distributed.fsdp._fully_shard._fsdp_api:ReduceScatter",
             "parallel/zero_units.py"),
    Internal("torch.distributed.fsdp:FSDPModule._get_fsdp_state", "parallel/zero.py"),
    Internal("torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam",
             "parallel/zero.py, parallel/zero_units.py (_sharded_param_data, "
             "_unsharded_param)"),
    Internal("torch.utils._foreach_utils:_group_tensors_by_device_and_dtype",
             "parallel/grad_norm.py"),
    Internal("torch.utils._foreach_utils:_get_fused_kernels_supported_devices",
             "training/optim.py"),
    Internal("torch._C:_current_graph_task_id", "model/fused_linear.py"),
    Internal("torch.utils._python_dispatch:TorchDispatchMode",
             "parallel/comm_stats.py, training/live_bytes.py, training/fake_cuda.py"),
    Internal("torch._C:_get_dispatch_mode", "training/live_bytes.py"),
    Internal("torch.ops.aten:_scaled_dot_product_flash_attention_for_cpu",
             "model/attention/fused.py"),
    Internal("torch.ops.aten:_scaled_dot_product_flash_attention_for_cpu_backward",
             "model/attention/fused.py"),
    Internal("torch.ops.mkldnn:_linear_pointwise", "model/ops/onednn.py (when oneDNN is "
             "built)"),
    Internal("torch.ops.aten:_scaled_dot_product_flash_attention", "model/attention/fused.py"),
    Internal("torch.ops.aten:_scaled_dot_product_flash_attention_backward",
             "model/attention/fused.py"),
    Internal("torch.ops.aten:_scaled_dot_product_efficient_attention",
             "model/attention/fused.py"),
    Internal("torch.ops.aten:_scaled_dot_product_efficient_attention_backward",
             "model/attention/fused.py"),
    Internal("torch:_foreach_norm", "parallel/grad_norm.py"),
    Internal("torch:_foreach_mul_", "parallel/grad_norm.py"),
    Internal("torch.ops._c10d_functional:wait_tensor", "parallel/comm_stats.py, "
             "training/live_bytes.py"),
    Internal("torch._inductor.config:fallback_random", "parallel/compile.py"),
    Internal("torch._inductor.config:emulate_precision_casts", "parallel/compile.py"),
    Internal("torch._dynamo.callback:callback_handler", "parallel/compile.py"),
    Internal("torch.utils._pytree:tree_leaves", "training/live_bytes.py"),
    Internal("torch._ops:OpOverload", "training/live_bytes.py (a type annotation)"),
    *(Internal(name, "training/fake_device.py, training/fake_cuda.py", startup=False)
      for name in ("torch._subclasses.fake_tensor:FakeTensorMode",
                   "torch._subclasses.fake_tensor:FakeTensorDeviceMismatchError",
                   "torch.testing._internal.distributed.fake_pg:FakeStore",
                   "torch.utils._pytree:tree_map", "torch._C:_acc.create_empty_tensor",
                   "torch._C:_get_privateuse1_backend_name", "torch._C:_ExcludeDispatchKeyGuard",
                   "torch._C:_TorchDispatchModeKey.FAKE", "torch._C:DispatchKeySet",
                   "torch._C:DispatchKey.AutocastPrivateUse1",
                   "torch.ops.aten:_local_scalar_dense")),
    Internal("torch._C._distributed_c10d:FakeWork", "training/fake_cuda.py", startup=False),
]
OPTIONAL = {"torch.ops.mkldnn:_linear_pointwise"}  # a build without oneDNN falls back


def _resolve(name: str) -> object:
    import torch  # here, not at import: pretrain_gpt.py checks its flags before torch loads
    module, _, attr = name.partition(":")
    if module.startswith("torch.ops"):  # an operator namespace, not a module
        obj: object = getattr(torch.ops, module.split(".")[-1])
    else:
        obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def problem(item: Internal) -> str | None:
    """What is wrong with `item` in this torch (None: present, as expected)."""
    try:
        obj = _resolve(item.name)
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"missing ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if item.expect:
        try:
            params = set(inspect.signature(obj).parameters)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        lost = [p for p in item.expect if p not in params]
        if lost:
            return f"changed: no parameter {', '.join(lost)}"
    return None


def check(items: list[Internal] = INTERNALS,
          log: Callable[[str], None] | None = None) -> None:
    """Raise TorchInternalsError (one line) on the first part this torch lacks that every
    run needs (`startup`)."""
    import torch
    for item in (i for i in items if i.startup):
        why = problem(item)
        if why and item.name not in OPTIONAL:
            raise TorchInternalsError(
                f"torch {torch.__version__}: {item.name} (used by {item.used_by}) is {why}; "
                f"megaulysses is tested with torch {TESTED} (README, Versions)")
        if why and log is not None:
            log(f"torch {torch.__version__}: {item.name} is {why}; {item.used_by} falls back")
