"""The memory plan: bytes per rank of one pipeline stage, predicted from the config alone.

`plan_memory(cfg, dims, pp_rank)` is arithmetic: no tensor is allocated and no process
group is needed (the GPT is built on the meta device to list the stage's parameters). It
describes *this* implementation: what autograd saves in model/gpt.py, layers.py and
ops/ and attention/, what ZeRO (parallel/zero.py, grad_reduce.GradReducer, FSDP2) and
torch's pipeline schedules hold, and when. `pretrain_gpt.py --dry-run` prints it for
every stage, the trainer logs it at start-up, and tests/parallel/test_memory_plan.py holds
it to within 10% of the live tensor bytes real ranks reach (and its communication bytes
to what they send).

The accounting is split by concern: shapes.py (what this rank runs, the sizes its
tensors are made of, the attention core), states.py (parameters, gradients, optimizer
states, ZeRO, gradient buckets), activations.py and cores.py (what a micro-batch keeps,
recomputation, the attention cores' working sets), moments.py (where the peak can be),
traffic.py (bytes sent per iteration), report.py (`MemoryPlan`, `format_plan`). Each
module's doc gives its part of the model.

Not modelled: forward-time peaks outside recomputation (the explicit `math`
attention backend's S*S temporaries: ~7% above the plan); backend scratch inside
collectives and kernels; packed documents' effect on the keys a block attends (the plan
assumes one document).
"""

from __future__ import annotations

from typing import Optional

import torch

from megaulysses.config import Config
from megaulysses.parallel.dims import ParallelDims
from megaulysses.planner.memory.activations import _Activations
from megaulysses.planner.memory.cores import core_scratch
from megaulysses.planner.memory.moments import _held_outside_model, _moments
from megaulysses.planner.memory.report import MemoryPlan
from megaulysses.planner.memory.shapes import _describe, _RankLayout, _shape, _zero_ranks
from megaulysses.planner.memory.states import _stage_params, _States
from megaulysses.planner.memory.traffic import bytes_by_kind, comm_bytes


def plan_memory(cfg: Config, dims: ParallelDims, pp_rank: int = 0,
                device_type: Optional[str] = None, cp_rank: int = 0) -> MemoryPlan:
    """The plan of pipeline rank `pp_rank` (`cfg` validated, `cfg.model.vocab_size` set
    from the tokenizer). `device_type`: where the run would be (None: cuda if available,
    else cpu, as the trainer picks); it decides the attention kernel and the loss's
    chunks. `cp_rank`: the ring rank (the zigzag gives the ranks different keys per ring
    step: under the causal mask alone the last one fewer, rank 0, the default, the most;
    with a window another rank may hold more)."""
    if cfg.model.vocab_size <= 0:
        raise ValueError("plan_memory needs cfg.model.vocab_size (from the tokenizer)")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    rank = _RankLayout.of(cfg, dims, pp_rank)
    s = _shape(cfg, dims, device_type, cp_rank)
    states = _States(_stage_params(cfg, dims, rank), rank.zero_stage, _zero_ranks(dims),
                     dims.pp > 1, s, cfg)
    acts = _Activations(s, cfg, rank)
    other = _held_outside_model(s, rank, dims.pp, acts.recompute == "full")
    moments = _moments(states, acts, rank, other)
    name = max(moments, key=lambda k: sum(moments[k].values()))
    peak = moments[name]
    by_group = comm_bytes(cfg, dims, s, states, acts, rank)
    return MemoryPlan(
        pp_rank=pp_rank, zero_stage=rank.zero_stage, layers=rank.layers,
        micro_batches=rank.m, in_flight=rank.in_flight, tokens=s.T,
        param_bytes=peak["params"], grad_bytes=peak["grads"],
        optimizer_bytes=peak["optimizer"], activation_bytes_per_layer=acts.per_layer,
        activation_bytes=peak["activations"], transient_bytes=peak["transient"],
        peak_bytes=sum(peak.values()), peak_moment=name, attention=_describe(s),
        moments={k: sum(v.values()) for k, v in moments.items()}, layer_terms=acts.terms,
        comm_bytes=bytes_by_kind(by_group), comm_by_group=by_group,
        recomputed_layers=acts.rerun[0], host_bytes=states.host,
        host_link_bytes=states.host_link, param_link_bytes=states.param_link_bytes(rank.m),
        # every in-flight micro-batch (model chunk) keeps its share of the stage's copies
        offload_bytes=acts.host * rank.in_flight // rank.chunks + acts.fpdt_host,
        offload_link_bytes=(acts.host + acts.fpdt_link) * rank.m,
        unmeasured_bytes=core_scratch(s) if rank.layers else 0)
