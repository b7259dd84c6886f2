"""The schema's sections for how a run is laid out and watched: logging, the parallel grid
and activation memory (schema.py holds the model, data and training sections and the
whole Config; the same `option(...)` declarations, one field per flag)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaulysses.config.fields import Flag, option
from megaulysses.config.groups import TRAINING

PIPELINE_SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble", "gpipe")
ZERO_STAGES = (0, 1, 2, 3)
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class LogConfig:
    log_interval: int = option(
        100, "log (and write --metrics-jsonl) every this many iterations", kind="positive")
    tensorboard_dir: Optional[str] = option(None, "write TensorBoard scalars here")
    metrics_jsonl: Optional[str] = option(
        None, "write one JSON record per logged iteration and evaluation here")
    peak_tflops: Optional[float] = option(
        None, "peak TFLOP/s per device for MFU; default: known GPU table, or a matmul measured "
        "at start-up on CPU", kind="number")
    # issue 28: observability (training/profiling.py, training/wandb_writer.py, report.py)
    log_params_norm: bool = option(
        False, "log the L2 norm of all parameters after each step, each parameter once over "
        "every rank's shards: 'params norm' in the log line, params_norm in --metrics-jsonl, "
        "tensorboard and wandb", action="store_true")
    log_num_zeros_in_grad: bool = option(
        False, "log the number of zero entries of the reduced gradients, each parameter once: "
        "'num zeros' in the log line, num_zeros in --metrics-jsonl, tensorboard and wandb",
        action="store_true")
    tensorboard_log_interval: int = option(
        1, "every this many iterations, write that iteration's loss, lr, grad norm, step time "
        "(and params norm, num zeros, timers) to tensorboard and wandb; throughput, memory and "
        "communication bytes go there every --log-interval", kind="positive")
    log_timers_to_tensorboard: bool = option(
        False, "time forward, backward, optimizer and each collective kind (on CUDA the device "
        "is synchronized around each) and write them to tensorboard and wandb as time_*_s: "
        "seconds per iteration since the last write, of the slowest rank", action="store_true")
    profile: bool = option(
        False, "record a torch.profiler trace of the steps after --profile-step-start "
        "iterations up to iteration --profile-step-end, on --profile-ranks, to "
        "<--tensorboard-dir>/../torch_profile/rank-N.pt.trace.json.gz (TensorBoard's profile "
        "plugin, Perfetto)", action="store_true")
    profile_step_start: int = option(
        10, "--profile: the trace starts after this many iterations", kind="int")
    profile_step_end: int = option(
        12, "--profile: the trace ends after this iteration", kind="int")
    profile_ranks: list = option(
        [], "--profile: the global ranks that record a trace (default: every rank, as "
        "Megatron-LM's)", nargs="+", kind="int")
    wandb_project: Optional[str] = option(
        None, "log tensorboard's scalars to this Weights & Biases project too (needs the "
        "wandb package; offline, into --wandb-save-dir, unless WANDB_MODE or an API key says "
        "otherwise)")
    wandb_exp_name: Optional[str] = option(
        None, "the wandb run's name (required with --wandb-project)")
    wandb_save_dir: Optional[str] = option(
        None, "with --wandb-project: the directory wandb writes its run to; default: "
        "<--save>/wandb")
    wandb_entity: str = option(
        "", "with --wandb-project: the wandb entity (team or user) the run belongs to; "
        "default: the API key's own")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = option(
        1, "tensor-parallel degree tp (Megatron column/row-parallel layers)", kind="positive")
    tp_sequence_parallel: bool = option(  # Megatron-SP inside the tp group
        False, "Megatron-style sequence parallelism inside the tensor-parallel group",
        action="store_true", names=("--sequence-parallel",))
    ds_sequence_parallel_size: int = option(
        1, "Ulysses sequence-parallel degree U (all-to-all; heads / tp / U heads per rank)",
        kind="positive", names=("--ds-sequence-parallel-size", "--ulysses-degree"))
    context_parallel_size: int = option(
        1, "ring attention degree C over groups of U Ulysses ranks (sequence degree U * C; "
        "zigzag chunks for causal balance)", kind="positive")
    pipeline_model_parallel_size: int = option(
        1, "pipeline stages (layers split into consecutive blocks)", kind="positive")
    pipeline_schedule: Optional[str] = option(
        None, "the order of micro-batch forwards and backwards over the stages; default: 1f1b, "
        "or interleaved-1f1b with --num-layers-per-virtual-pipeline-stage",
        choices=PIPELINE_SCHEDULES)
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "layers per model chunk; each pipeline rank then holds layers / (pp * this) chunks "
        "(interleaved schedules)", kind="positive")
    decoder_first_pipeline_num_layers: Optional[int] = option(
        None, "layers on the first stage (uneven split; the rest evenly)", kind="int")
    decoder_last_pipeline_num_layers: Optional[int] = option(
        None, "layers on the last stage (uneven split; the rest evenly)", kind="int")
    zero_stage: int = option(
        0, "ZeRO over the data x sequence-parallel ranks: 1 shards optimizer states, 2 also "
        "gradients, 3 also parameters (see README)", kind="int", choices=ZERO_STAGES, after=(Flag(
            "= --zero-stage 3, which is torch's FSDP2 here (Megatron-LM's name)",
            names=("--use-torch-fsdp2",), action="store_const", const=3),))
    use_distributed_optimizer: bool = option(
        False, "Megatron-LM's distributed optimizer: under --bf16/--fp16 16-bit weights, a "
        "gradient buffer (fp32, or bf16 with --grad-reduce-in-bf16), fp32 main weights and "
        "Adam moments sharded over the data x sequence-parallel ranks (6 + 12/N or 4 + 16/N "
        "bytes per parameter); under fp32 = --zero-stage 1; a higher --zero-stage shards more "
        "and stays", action="store_true")
    grad_reduce_dtype: str = option(
        "fp32", "dtype in which gradients are summed over the data x sequence-parallel ranks",
        choices=GRAD_REDUCE_DTYPES, after=(Flag(
            "= --grad-reduce-dtype bf16 (Megatron-LM's)", names=("--grad-reduce-in-bf16",),
            action="store_const", const="bf16"),))
    no_gradient_accumulation_fusion: bool = option(
        False, "with the distributed optimizer under --bf16/--fp16: each linear layer's "
        "weight gradient made in 16 bits by autograd, then added into the gradient buffer "
        "(Megatron-LM's unfused path). Without it, Megatron-LM's fusion: added into the "
        "buffer in its dtype (fp32: no 16-bit rounding, no per-micro-batch 16-bit gradient; apex's "
        "fused_weight_gradient_mlp_cuda on CUDA where installed, else torch); "
        "tensor-parallel weights and zero-bubble keep the unfused path",
        action="store_true")
    accumulate_allreduce_grads_in_fp32: bool = option(
        False, "the distributed optimizer's gradient buffer in fp32 (micro-batches summed and "
        "reduced in fp32), as in Megatron-LM, which sets it itself under --bf16 (unless "
        "--grad-reduce-in-bf16); under --fp16 the buffer is fp16 without it. ZeRO-0/1 "
        "without the distributed optimizer and FSDP sum the gradients of fp32 weights in "
        "fp32 anyway", action="store_true")
    overlap_param_gather: bool = option(
        False, "with the distributed optimizer: each bucket's all-gather of the updated "
        "weights runs while the next step's first forward reaches it (its forward waits "
        "for it), not after the step; ZeRO-2/3 gather ahead of each block anyway",
        action="store_true")
    ddp_bucket_size: Optional[int] = option(
        None, "parameters per gradient bucket (Megatron-LM's count): each bucket is reduced as "
        "one (all-reduced at --zero-stage 0, reduce-scattered at 1 and by the distributed "
        "optimizer, whose weights' all-gather goes by the same buckets); default: 25 MiB of "
        "gradients (of 16-bit weights in the distributed optimizer). FSDP (--zero-stage 2/3) "
        "reduces block by block", kind="positive")
    ddp_num_buckets: Optional[int] = option(
        None, "about this many gradient buckets (parameters // this per bucket; it wins over "
        "--ddp-bucket-size, as in Megatron-LM)", kind="positive")
    optimizer_cpu_offload: bool = option(
        False, "with --use-distributed-optimizer: the fp32 main weights and Adam moments (of "
        "--optimizer-offload-fraction of the parameters) live and step on the host, in "
        "pinned memory, with torch's fused CPU AdamW; the reduced gradients go there and the "
        "updated 16-bit weights come back", action="store_true")
    optimizer_offload_fraction: float = option(
        1.0, "with --optimizer-cpu-offload: the fraction of the parameters (by count, in "
        "order) whose optimizer state is on the host, in [0, 1]", kind="number")
    overlap_cpu_optimizer_d2h_h2d: bool = option(
        False, "with --optimizer-cpu-offload: copy each bucket's gradients to the host as its "
        "reduction ends, and its updated weights back, asynchronously (CUDA streams; on a "
        "CPU there is nothing to overlap)", action="store_true")
    zero_param_offload: bool = option(  # ours: Megatron-LM has none (its offload is above)
        False, "ZeRO-3 only: each unit's parameter and gradient shards, and so the optimizer "
        "step, on the host (FSDP2's CPUOffloadPolicy; DeepSpeed's offload_param, torchtitan's "
        "enable_cpu_offload); the 16-bit weights come to the device per unit for its forward "
        "and backward", action="store_true")
    distributed_timeout_minutes: float = option(
        10.0, "a collective that waits longer than this (a rank died or hangs) fails, and every "
        "rank exits non-zero naming the rank(s) it lost", kind="number")
    torch_compile: bool = option(  # ours: Megatron-LM has none (torchtitan: --compile.enable)
        False, "compile each transformer block and the loss with torch.compile (inductor; "
        "one compiled code for every block, static shapes). An attention core that cannot "
        "compile yet (Ulysses, ring, head groups, FPDT, selective recomputation, a mask "
        "other than causal, attention dropout) runs eagerly between the graphs of the rest "
        "of the block; zero-bubble, and the distributed optimizer's gradient-accumulation "
        "fusion or --overlap-param-gather, run the model eagerly. The start-up log says "
        "what compiled, then the first step's compile time",
        action="store_true", group=TRAINING)


@dataclass(frozen=True)
class MemoryConfig:
    """Activation memory: recomputation (Megatron-LM's flags) and tiling, and the dry run."""
    recompute_granularity: Optional[str] = option(
        None, "full: recompute whole transformer blocks in backward (only their inputs are kept; "
        "the forward all-to-alls run again); selective: recompute only the attention core "
        "(between the all-to-alls); default: none (no recomputation)",
        choices=RECOMPUTE_GRANULARITIES, after=(Flag(
            "= --recompute-granularity selective", names=("--recompute-activations",),
            action="store_const", const="selective"),))
    recompute_method: Optional[str] = option(
        None, "with --recompute-granularity full: uniform checkpoints groups of "
        "--recompute-num-layers consecutive layers; block checkpoints the first "
        "--recompute-num-layers layers of each pipeline stage and keeps the rest's activations "
        "(default uniform)", choices=RECOMPUTE_METHODS)
    recompute_num_layers: Optional[int] = option(
        None, "with --recompute-granularity full: see --recompute-method (default 1)",
        kind="positive")
    tiled_mlp_chunks: int = option(
        1, "run each MLP over the local sequence in this many chunks, recomputed in backward: "
        "its [tokens, ffn] intermediates exist for one chunk at a time", kind="positive",
        names=("--tiled-mlp-chunks", "--mlp-chunks-for-training"))  # the 2nd: Megatron-LM's
    cpu_offloading_num_layers: int = option(
        0, "with --recompute-granularity full: the inputs that recomputation keeps of the "
        "groups starting in the first N layers of each pipeline stage go to (pinned) host "
        "memory once forward has used them, and come back one group ahead of their "
        "recomputation (default 0: none)", kind="int")
    attention_head_groups: int = option(
        1, "run each layer's attention (under Ulysses: the all-to-alls and the core) for "
        "this many groups of the rank's heads one after another, each recomputed in "
        "backward: the whole-sequence q, k, v and output exist for one group at a time; "
        "must divide the heads a rank attends over", kind="positive")
    ds_sequence_parallel_fpdt: bool = option(
        False, "attention by chunks of the sequence (FPDT): under Ulysses the all-to-alls "
        "and the core, at sp 1 the core alone, run per chunk of "
        "--ds-sequence-parallel-fpdt-chunk-size tokens, so the whole-sequence q, k, v, "
        "output and their gradients never exist at once in the core; no ring",
        action="store_true")
    ds_sequence_parallel_fpdt_chunk_size: int = option(
        65536, "with --ds-sequence-parallel-fpdt: tokens of the whole sequence per chunk "
        "(sp ranks hold 1/sp of them each before the all-to-all); the sequence if shorter",
        kind="positive")
    ds_sequence_parallel_fpdt_offloading: bool = option(
        False, "with --ds-sequence-parallel-fpdt: what attention keeps for backward (the "
        "chunks of q, k, v, the output) and the key/value gradient sums live in (pinned) "
        "host memory; each chunk comes to the device while it is used", action="store_true")
    dry_run: bool = option(
        False, "validate every flag, build the model on the meta device, print the per-rank "
        "memory plan and communication bytes, exit 0 without allocating the model or training",
        action="store_true")
    dry_run_world_size: Optional[int] = option(
        None, "with --dry-run on one process: the number of ranks of the grid to plan for "
        "(default: WORLD_SIZE, or 1)", kind="positive")
    dry_run_device: Optional[str] = option(
        None, "with --dry-run: the device to plan for; it picks the attention kernel and the "
        "loss's chunks (default: cuda if available, else cpu)", choices=("cpu", "cuda"))
    dry_run_gpu: Optional[str] = option(
        None, "with --dry-run: plan for cuda and exit 2 unless every stage fits this GPU "
        "(A100-40GB, A100-80GB, H100, H200: tools/plan.py's table) less 4 GiB reserved for the "
        "CUDA context, NCCL and fragmentation", kind="gpu")
