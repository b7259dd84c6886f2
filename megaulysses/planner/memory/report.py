"""The memory plan's result (`MemoryPlan`) and its table (`format_plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 2 ** 20


@dataclass
class MemoryPlan:
    """Bytes one rank of pipeline stage `pp_rank` holds (rank 0 of its dp x cp x sp
    group)."""

    pp_rank: int
    zero_stage: int  # in effect (0 when dp x cp x sp is one rank)
    layers: int  # transformer layers on this rank
    micro_batches: int  # per step
    in_flight: int  # micro-batches (model chunks) whose activations are held at once
    tokens: int  # T: tokens of a micro-batch on this rank
    param_bytes: int  # parameters and buffers held at the peak moment
    grad_bytes: int  # gradients held at the peak moment
    optimizer_bytes: int  # AdamW's states
    activation_bytes_per_layer: int  # what one layer keeps for one micro-batch
    activation_bytes: int  # kept for backward at the peak moment, all micro-batches
    transient_bytes: int  # at the peak: recomputed activations, temporaries, buckets,
    # the step's batches, the pipeline's receive buffers
    peak_bytes: int  # the sum of the five above at the largest moment
    peak_moment: str
    moments: dict = field(default_factory=dict)  # every moment considered -> its bytes
    layer_terms: dict = field(default_factory=dict)  # what a layer keeps, by term (full
    # recomputation: what it holds while recomputed)
    comm_bytes: dict = field(default_factory=dict)  # collective kind -> bytes/iteration
    comm_by_group: dict = field(default_factory=dict)  # (mesh dim, kind) -> bytes/iteration
    attention: str = ""  # the attention core the plan assumes, in words
    recomputed_layers: int = 0  # layers whose forward runs again per micro-batch (full)
    host_bytes: int = 0  # on the host, beside the device (--optimizer-cpu-offload,
    # --zero-param-offload)
    host_link_bytes: int = 0  # copied to the host and back per step, each way
    # --zero-param-offload: the units' shards up and gradient shards down per step (both
    # ways together), issued with the prefetched collectives
    param_link_bytes: int = 0
    offload_bytes: int = 0  # activations in host memory at the peak (--cpu-offloading-*)
    offload_link_bytes: int = 0  # activations copied to the host and back per step, each way
    # bytes of the peak no rank measures: the fused attention backward's own buffers
    # (cores.py `core_scratch`), planned from the kernel's source alone
    unmeasured_bytes: int = 0


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a small table (MiB per rank), for the start-up log and --dry-run."""
    mib = lambda n: f"{n / MIB:,.1f}"  # noqa: E731
    flight = f"{plan.in_flight} micro-batch{'es' if plan.in_flight > 1 else ''} in flight"
    rows = [("parameters", plan.param_bytes), ("gradients", plan.grad_bytes),
            ("optimizer states", plan.optimizer_bytes),
            (f"activations ({flight})", plan.activation_bytes),
            ("transient working set", plan.transient_bytes),
            (f"peak ({plan.peak_moment})", plan.peak_bytes)]
    width = max(len(name) for name, _ in rows)
    lines = [f"memory plan, pipeline rank {plan.pp_rank}: {plan.layers} layers, ZeRO stage "
             f"{plan.zero_stage}, {plan.micro_batches} micro-batches of {plan.tokens} tokens "
             "per rank; MiB per rank"]
    if plan.attention:
        lines.append(f"  attention core: {plan.attention}")
    lines += [f"  {name:<{width}}  {mib(n):>12}" for name, n in rows]
    terms = ", ".join(f"{k} {mib(v)}" for k, v in plan.layer_terms.items())
    held = sum(plan.layer_terms.values())
    lines.append(f"  activations kept per layer: {mib(plan.activation_bytes_per_layer)}"
                 + (f" (recomputed, a layer holds {mib(held)} in its backward: {terms})"
                    if held != plan.activation_bytes_per_layer else f" ({terms})"))
    if plan.param_link_bytes:
        lines.append(f"  host memory (--zero-param-offload): {mib(plan.host_bytes)} of "
                     "parameter and gradient shards and optimizer states, not in the peak; "
                     f"{mib(plan.param_link_bytes)} per step over the host link (shards up, "
                     "gradients down, unit by unit)")
    elif plan.host_bytes:
        lines.append(f"  host memory (--optimizer-cpu-offload): {mib(plan.host_bytes)}, not in "
                     f"the peak; {mib(plan.host_link_bytes)} each way per step over the host "
                     "link")
    if plan.offload_bytes:
        lines.append(f"  host memory (--cpu-offloading-num-layers): {mib(plan.offload_bytes)} "
                     f"of activations, not in the peak; {mib(plan.offload_link_bytes)} each "
                     "way per step over the host link")
    if plan.comm_bytes:
        lines.append("  communication per iteration, MiB sent: " + ", ".join(
            f"{k} {mib(v)}" for k, v in plan.comm_bytes.items()))
    return "\n".join(lines)
