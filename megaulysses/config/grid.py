"""The grid's sizes, ParallelDims(dp, tp, pp, sp, cp), and the mesh dimension names: plain
arithmetic, no torch (parallel/dims.py builds the DeviceMesh from them).

Mesh dims are ("pp", "dp", "cp", "sp", "tp"), tp fastest-varying: consecutive ranks share a
tp group, then an sp (Ulysses) group, so both stay inside a node where the bandwidth is;
the ring of cp (context-parallel) ranks, whose traffic is point-to-point and overlaps
compute, spans further. The sequence degree is sp * cp. The flattened "dp_sp" dim
(dp x cp x sp) is the group over which the loss, gradients and ZeRO are reduced:
sequence-parallel ranks hold the same parameters and see different tokens, exactly like
data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaulysses.config.errors import ConfigError

# The mesh dimension names: every group is named by one of these, and only here are they
# spelled out.
PP, DP, CP, SP, TP = "pp", "dp", "cp", "sp", "tp"
DP_SP = "dp_sp"  # dp x cp x sp flattened: the ranks that see different tokens of one model
MESH_DIMS = (PP, DP, CP, SP, TP)  # slowest- to fastest-varying


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    sp: int
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp * self.cp

    @property
    def seq_degree(self) -> int:
        """Ranks one sample's sequence is split over: Ulysses x ring."""
        return self.sp * self.cp

    @classmethod
    def from_world(cls, world: int, tp: int = 1, pp: int = 1, sp: int = 1,
                   cp: int = 1) -> "ParallelDims":
        """dp is derived: world / (tp * pp * sp * cp), as in Megatron."""
        model_parallel = tp * pp * sp * cp
        if world % model_parallel:
            sizes = {"--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp,
                     "--ds-sequence-parallel-size": sp, "--context-parallel-size": cp}
            flag = "/".join(f for f, n in sizes.items() if n > 1)  # the ones that were set
            raise ConfigError(flag, f"the product tp*pp*sp*cp = {tp}*{pp}*{sp}*{cp} = "
                              f"{model_parallel} must divide the world size {world}")
        return cls(dp=world // model_parallel, tp=tp, pp=pp, sp=sp, cp=cp)
