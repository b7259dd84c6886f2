"""The memory plan: bytes per rank of one pipeline stage, predicted from the config alone
(`plan_memory`; plan.py's doc has the overview, each module's doc its part of the model),
and its table (`format_plan`)."""

# The loss's chunk budget, the very dict (benchmarks/long_sequence.py raises it for both).
from megaulysses.model.ops.cross_entropy import CHUNK_ELEMENTS as CE_BUDGET
from megaulysses.planner.memory.activations import _Activations  # noqa: F401 (tests)
from megaulysses.planner.memory.cores import (_ring_fused_backward,  # noqa: F401 (tests)
                                              _ring_fused_forward)
from megaulysses.planner.memory.plan import plan_memory
from megaulysses.planner.memory.report import MIB, MemoryPlan, format_plan
from megaulysses.planner.memory.shapes import (F32, _RankLayout, _Shape,  # noqa: F401 (tests)
                                               _shape)
from megaulysses.planner.memory.traffic import bytes_by_kind, comm_bytes

__all__ = ["CE_BUDGET", "F32", "MIB", "MemoryPlan", "bytes_by_kind", "comm_bytes",
           "format_plan", "plan_memory"]
