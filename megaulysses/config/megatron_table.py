"""What each Megatron-LM flag that pretrain_gpt.py has no flag for means here: data, read
by megatron.py. Two kinds:

- no effect: it selects only Megatron-LM's internals (kernel fusions, communication
  overlap and bucketing, NCCL / Transformer Engine / CUDA-graph options, checkpoint
  formats, dataloader internals, logging extras, NVIDIA's resiliency tools), or asks for
  what is already so here. Accepted, parsed as Megatron-LM parses it, logged once with
  the reason. The reason says why nothing changes.
- refused: it changes the model, the math, the data or the schedule in a way not
  provided here (FP8, MoE, Mamba, other activations, ...). The run stops before anything
  else with one line naming it. The reason names the feature. Given with Megatron-LM's
  own default (or a value in SAME_HERE), it asks for nothing: accepted and logged.

A whole Megatron-LM argument group (its --help title) has one status and reason; FLAGS
lists the exceptions and the flags of the mixed groups (a row under any of a flag's names:
Megatron-LM's main spells a dataclass switch --no-X with --disable-X beside it); PREFIXES
gives a family of flags by its prefix (--moe-*, --fp8-*, ...: most of main's "transformer
configuration" group, TransformerConfig's fields). A flag added to the schema later
simply leaves these tables (megatron.py computes them against the live schema), and
tests/test_megatron_compat.py then asks for its row to go.
"""

from __future__ import annotations

from megaulysses.config.megatron_reasons import (NO_EFFECT, REFUSED, _FUSION, _OVERLAP, _NCCL,
                                                 _TP_OVERLAP, _CKPT_FORMAT, _CUDA_GRAPH, _GC,
                                                 _TB_EXTRA, _TIMERS, _TIKTOKEN, _GONE, _FSDP,
                                                 _LOCAL_CKPT, _CP_COMM, _WSD, _DECAY_SCHEDULE,
                                                 _ENCDEC)
from megaulysses.config.megatron_table_main import ADDED, PREFIXES  # noqa: F401

GROUPS: dict[str, tuple[str, str]] = {
    "moe": (REFUSED, "mixture of experts"),
    "mla": (REFUSED, "multi-latent attention"),
    "heterogeneous architecture": (REFUSED, "heterogeneous layers"),
    "rl": (REFUSED, "reinforcement learning (GRPO)"),
    "inference": (REFUSED, "Megatron-LM's inference engine"),
    "retro": (REFUSED, "Retro retrieval-augmented models"),
    "biencoder": (REFUSED, "biencoder / ICT retrieval models"),
    "vision": (REFUSED, "vision models"),
    "Transformer-Engine": (REFUSED, "FP8 / FP4 training"),
    "kitchen": (REFUSED, "kitchen quantization"),
    "sft": (REFUSED, "supervised fine-tuning"),
    "one logger": (NO_EFFECT, "NVIDIA's internal one-logger telemetry is not used here"),
    "In-process restart": (NO_EFFECT, "NVIDIA's in-process restart is not used here: a lost "
                                      "rank ends the run with one line, resume from --save"),
    "ft_package": (NO_EFFECT, "NVIDIA's fault-tolerance package is not used here"),
    "straggler": (NO_EFFECT, "Megatron-LM's straggler detector: no slowest-rank report "
                             "here; --log-timers-to-tensorboard shows the slowest rank"),
    "workload inspector": (NO_EFFECT, "Megatron-LM's on-demand profiling server; --profile "
                                      "records a trace here"),
    "rerun engine": (REFUSED, "Megatron-LM's error injection into its result validation "
                              "(result_checks.py validates as --rerun-mode says; inject "
                              "faults with MEGAULYSSES_FAULT in tests)"),
    "msc": (NO_EFFECT, "Multi-Storage Client is not used here: local files only"),
    "autoresume": (NO_EFFECT, "ADLR's cluster autoresume; --exit-signal-handler saves and "
                              "exits on SIGTERM here"),
    "Logits Distillation": (REFUSED, "logits distillation"),
    "fault injector": (REFUSED, "fault injection"),
    "opentelemetry": (REFUSED, "OpenTelemetry traces and metrics"),
}


# flag -> (status, reason), by Megatron-LM's groups. A flag here overrides its group's row.
FLAGS: dict[str, tuple[str, str]] = {
    # network size
    "--encoder-num-layers": (REFUSED, _ENCDEC),
    "--decoder-num-layers": (REFUSED, _ENCDEC),
    "--softmax-type": (REFUSED, "other attention softmaxes (off-by-one, learnable)"),
    "--window-attn-skip-freq": (REFUSED, "sliding-window attention on some layers only"),
    "--relative-attention-num-buckets": (REFUSED, "relative position embeddings (T5)"),
    "--relative-attention-max-distance": (REFUSED, "relative position embeddings (T5)"),
    "--rotary-percent": (REFUSED, "rotary embeddings on part of the head dimension"),
    "--rotary-interleaved": (REFUSED, "interleaved rotary embeddings (rotate-half here)"),
    "--no-rope-freq": (REFUSED, "layers without RoPE"),
    "--no-position-embedding": (NO_EFFECT, "Megatron-LM's deprecated switch: it needs "
                                           "--position-embedding-type rope, under which it "
                                           "changes nothing"),
    "--mrope-section": (REFUSED, "multimodal RoPE"),
    "--apply-residual-connection-post-layernorm": (REFUSED, "the post-norm residual order"),
    "--openai-gelu": (NO_EFFECT, "Megatron-LM's legacy models' GeLU switch, ignored by its "
                                 "Megatron-Core models: the GeLU follows --no-bias-gelu-fusion "
                                 "there and here"),
    "--squared-relu": (REFUSED, "the squared-ReLU activation"),
    "--quick-geglu": (REFUSED, "the quick-GeGLU activation"),
    "--activation-func-clamp-value": (REFUSED, "clamped activations"),
    "--glu-linear-offset": (REFUSED, "an offset in the GLU"),
    "--onnx-safe": (NO_EFFECT, "workarounds for the ONNX exporter: nothing is exported here"),
    "--bert-no-binary-head": (REFUSED, _ENCDEC),
    "--multi-latent-attention": (REFUSED, "multi-latent attention"),
    "--mtp-num-layers": (REFUSED, "multi-token prediction"),
    "--mtp-loss-scaling-factor": (REFUSED, "multi-token prediction"),
    # regularization
    "--start-weight-decay": (REFUSED, _DECAY_SCHEDULE),
    "--end-weight-decay": (REFUSED, _DECAY_SCHEDULE),
    "--weight-decay-incr-style": (REFUSED, _DECAY_SCHEDULE),
    "--sgd-momentum": (REFUSED, "the SGD optimizer"),
    **{f: (REFUSED, "the Muon optimizer") for f in (
        "--muon-momentum", "--muon-no-split-qkv", "--muon-use-nesterov", "--muon-scale-mode",
        "--muon-fp32-matmul-prec", "--muon-num-ns-steps", "--muon-tp-mode",
        "--muon-extra-scale-factor")},
    # training
    "--batch-size": (REFUSED, f"{_GONE}: use --micro-batch-size"),
    "--decrease-batch-size-if-needed": (REFUSED, "a global batch decreased to fit the grid"),
    "--distribute-saved-activations": (REFUSED, "the inputs of recomputed layers split over "
                                                "the tensor-parallel ranks (each keeps them "
                                                "whole here; --sequence-parallel splits them)"),
    "--recompute-modules": (REFUSED, "recomputing chosen modules (--recompute-granularity "
                                     "selective recomputes the core attention here)"),
    "--no-clone-scatter-output-in-embedding": (NO_EFFECT, "a memory detail of Megatron-LM's "
                                                          "embedding: same values"),
    "--iterations-to-skip": (REFUSED, "skipping chosen iterations"),
    "--result-rejected-tracker-filename": (REFUSED, "Megatron-LM's file of rejected results: "
                                           "result validation logs them (every rank)"),
    "--disable-gloo-process-groups": (NO_EFFECT, "Megatron-LM's auxiliary gloo groups: none "
                                                 "are made here"),
    "--record-memory-history": (NO_EFFECT, "no CUDA memory history is recorded here; "
                                           "--dry-run plans the memory"),
    "--memory-snapshot-path": (NO_EFFECT, "no CUDA memory history is recorded here"),
    **{f: (NO_EFFECT, _TP_OVERLAP) for f in (
        "--tp-comm-overlap", "--tp-comm-overlap-cfg", "--disable-tp-comm-overlap-ag",
        "--disable-tp-comm-overlap-rs", "--tp-comm-overlap-rs-dgrad",
        "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad",
        "--tp-comm-bootstrap-backend", "--disable-tp-comm-split-ag",
        "--disable-tp-comm-split-rs")},
    "--use-cpu-initialization": (NO_EFFECT, "initial weights come from their own seeded "
                                            "generators here, the same on every device"),
    "--check-weight-hash-across-dp-replicas-interval": (NO_EFFECT, "Megatron-LM's replica "
                                                                   "consistency check"),
    "--train-sync-interval": (NO_EFFECT, "how far the CPU runs ahead of the GPU: speed only"),
    "--checkpoint-activations": (REFUSED, f"{_GONE}: use --recompute-activations"),
    "--no-bias-swiglu-fusion": (NO_EFFECT, _FUSION),
    "--use-fused-weighted-squared-relu": (REFUSED, "mixture of experts"),
    "--no-rope-fusion": (NO_EFFECT, _FUSION),
    "--cross-entropy-fusion-impl": (NO_EFFECT, _FUSION),
    "--use-flash-attn": (NO_EFFECT, "--attention-backend auto, the default, runs flash_attn "
                                    "on CUDA with --bf16 or --fp16 where it is installed and "
                                    "the mask allows; Megatron-LM's --attention-backend "
                                    "decides there too"),
    "--optimizer": (REFUSED, "other optimizers than Adam(W)"),
    "--use-torch-optimizer-for-cpu-offload": (NO_EFFECT, "--optimizer-cpu-offload steps "
                                                         "torch's fused CPU AdamW already"),
    **{f: (REFUSED, "unpinned host copies of --optimizer-cpu-offload") for f in (
        "--no-pin-cpu-grads", "--no-pin-cpu-params")},
    "--dump-param-to-param-group-map": (NO_EFFECT, "Megatron-LM's parameter-group map file "
                                                   "is not written here"),
    "--no-async-tensor-model-parallel-allreduce": (NO_EFFECT, "ignored by Megatron-LM too"),
    "--use-legacy-models": (REFUSED, "Megatron-LM's legacy model classes"),
    "--manual-gc-interval": (NO_EFFECT, _GC),
    "--no-manual-gc-eval": (NO_EFFECT, _GC),
    "--pipeline-model-parallel-comm-backend": (NO_EFFECT, _NCCL),
    "--high-priority-stream-groups": (NO_EFFECT, "CUDA stream priorities: speed only"),
    "--use-te-activation-func": (NO_EFFECT, _FUSION),
    # initialization
    "--data-parallel-random-init": (REFUSED, "different initial weights per data-parallel "
                                             "rank"),
    "--embedding-init-method-std": (REFUSED, "a separate init std for the embedding"),
    "--init-method-xavier-uniform": (REFUSED, "Xavier-uniform initialization"),
    # learning rate
    "--lr-wsd-decay-style": (REFUSED, _WSD),
    "--lr-wsd-decay-samples": (REFUSED, _WSD),
    "--lr-wsd-decay-iters": (REFUSED, _WSD),
    "--warmup": (REFUSED, f"{_GONE}: use --lr-warmup-fraction or --lr-warmup-iters"),
    "--override-opt_param-scheduler": (NO_EFFECT, "already so here: the schedule always "
                                                  "comes from the flags, never a checkpoint"),
    "--use-checkpoint-opt_param-scheduler": (REFUSED, "the schedule from the checkpoint (it "
                                                      "always comes from the flags here)"),
    # checkpointing
    "--load-main-params-from-ckpt": (NO_EFFECT, "already so here: checkpoints hold the fp32 "
                                                "weights"),
    "--no-strict-fsdp-dtensor-load": (NO_EFFECT, _CKPT_FORMAT),
    **{f: (REFUSED, _LOCAL_CKPT) for f in (
        "--non-persistent-save-interval", "--non-persistent-ckpt-type",
        "--non-persistent-global-ckpt-dir", "--non-persistent-local-ckpt-dir",
        "--non-persistent-local-ckpt-algo", "--replication", "--replication-jump",
        "--replication-factor")},
    "--finetune": (REFUSED, "fine-tuning from --load with the iteration reset to 0"),
    "--pretrained-checkpoint": (REFUSED, "fine-tuning from a pretrained checkpoint"),
    "--ckpt-step": (REFUSED, "loading a chosen iteration (the latest is loaded here)"),
    "--no-initialization": (NO_EFFECT, "start-up time only: the model is built on the meta "
                                       "device here"),
    "--use-mp-args-from-checkpoint-args": (REFUSED, "parallel flags read from the checkpoint"),
    "--no-use-tokenizer-model-from-checkpoint-args": (NO_EFFECT, "already so here: the "
                                                                 "tokenizer comes from the "
                                                                 "flags"),
    **{f: (NO_EFFECT, _CKPT_FORMAT) for f in (
        "--use-dist-ckpt", "--use-persistent-ckpt-worker", "--auto-detect-ckpt-format",
        "--dist-ckpt-format", "--ckpt-format", "--ckpt-convert-update-legacy-dist-opt-format",
        "--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save",
        "--ckpt-fully-parallel-load", "--ckpt-assume-constant-structure",
        "--dist-ckpt-strictness", "--dist-ckpt-save-pre-mcore-014",
        "--dist-ckpt-optim-fully-reshardable",
        "--distrib-optim-fully-reshardable-mem-efficient")},
    "--ckpt-convert-format": (REFUSED, "converting checkpoints in the run "
                                       "(tools/convert_checkpoint.py does)"),
    "--ckpt-convert-save": (REFUSED, "converting checkpoints in the run "
                                     "(tools/convert_checkpoint.py does)"),
    # mixed precision
    "--apply-query-key-layer-scaling": (REFUSED, "query-key scaling by the layer number"),
    "--attention-softmax-in-fp32": (NO_EFFECT, "already so here: every attention kernel "
                                               "computes the softmax in fp32"),
    "--fp16-lm-cross-entropy": (REFUSED, "a 16-bit cross entropy"),
    "--disable-bf16-reduced-precision-matmul": (REFUSED, "bf16 matmuls without "
                                                         "reduced-precision reductions"),
    "--reuse-grad-buf-for-mxfp8-param-ag": (REFUSED, "FP8 / FP4 training"),
    # distributed
    "--pipeline-model-parallel-layout": (REFUSED, "custom pipeline layouts (use "
                                                  "--decoder-first/last-pipeline-num-layers)"),
    "--model-parallel-size": (REFUSED, f"{_GONE}: use --tensor-model-parallel-size"),
    "--num-virtual-stages-per-pipeline-rank": (REFUSED, "virtual stages by count (use "
                                                        "--num-layers-per-virtual-pipeline-"
                                                        "stage)"),
    "--microbatch-group-size-per-virtual-pipeline-stage": (NO_EFFECT, "the interleaved "
                                                                      "schedule's order is "
                                                                      "torch's here: same "
                                                                      "gradients"),
    "--no-overlap-p2p-communication": (NO_EFFECT, _OVERLAP),
    "--overlap-p2p-communication-warmup-flush": (NO_EFFECT, _OVERLAP),
    "--distributed-timeout-seconds-after-init": (NO_EFFECT, "the timeout of every collective "
                                                            "is --distributed-timeout-minutes "
                                                            "here"),
    "--defer-embedding-wgrad-compute": (NO_EFFECT, "when a weight gradient is computed: "
                                                   "speed only"),
    "--wgrad-deferral-limit": (NO_EFFECT, "when a weight gradient is computed: speed only"),
    "--no-align-grad-reduce": (NO_EFFECT, _OVERLAP),
    "--ddp-pad-buckets-for-high-nccl-busbw": (NO_EFFECT, _OVERLAP),
    "--ddp-reduce-scatter-with-fp32-accumulation": (REFUSED, "16-bit gradients summed in fp32 "
                                                             "inside the reduce-scatter"),
    "--ddp-average-in-collective": (NO_EFFECT, "where the gradient sum is divided by the "
                                               "data-parallel size: same value"),
    "--overlap-param-gather-with-optimizer-step": (NO_EFFECT, _OVERLAP),
    "--no-align-param-gather": (NO_EFFECT, _OVERLAP),
    "--no-scatter-gather-tensors-in-pipeline": (NO_EFFECT, _OVERLAP),
    "--use-ring-exchange-p2p": (NO_EFFECT, _NCCL),
    "--local-rank": (NO_EFFECT, "the local rank comes from torchrun's LOCAL_RANK here"),
    "--lazy-mpu-init": (NO_EFFECT, "Megatron-LM's deferred initialization for external "
                                   "callers"),
    "--account-for-embedding-in-pipeline-split": (REFUSED, "pipeline splits counting the "
                                                           "embedding as a layer"),
    "--account-for-loss-in-pipeline-split": (REFUSED, "pipeline splits counting the loss as "
                                                      "a layer"),
    "--use-nccl-ub": (NO_EFFECT, _NCCL),
    "--disable-symmetric-registration": (NO_EFFECT, _NCCL),
    "--use-sharp": (NO_EFFECT, _NCCL),
    "--sharp-enabled-group": (NO_EFFECT, _NCCL),
    "--nccl-communicator-config-path": (NO_EFFECT, _NCCL),
    **{f: (REFUSED, _FSDP) for f in (
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--fsdp-double-buffer",
        "--suggested-communication-unit-size", "--enable-full-sharding-in-hsdp",
        "--torch-fsdp2-no-reshard-after-forward")},
    "--keep-fp8-transpose-cache": (REFUSED, "FP8 / FP4 training"),
    "--init-model-with-meta-device": (NO_EFFECT, "already so here: the model is built on the "
                                                 "meta device"),
    "--no-gradient-reduce-div-fusion": (NO_EFFECT, _FUSION),
    "--num-distributed-optimizer-instances": (REFUSED, "partial distributed-optimizer "
                                                       "sharding"),
    "--cp-comm-type": (REFUSED, _CP_COMM),
    "--hierarchical-context-parallel-sizes": (REFUSED, _CP_COMM),
    "--use-tp-pp-dp-mapping": (NO_EFFECT, "the order ranks are placed in the grid: speed "
                                          "only"),
    # validation
    "--full-validation": (REFUSED, "evaluation over the whole validation set (--eval-iters "
                                   "here)"),
    "--multiple-validation-sets": (REFUSED, "several validation sets"),
    "--test-mode": (NO_EFFECT, "Megatron-LM's own functional tests"),
    "--skip-train": (REFUSED, "evaluation without training"),
    # data and dataloader
    "--train-data-path": (REFUSED, "a data path per split (use --data-path and --split)"),
    "--valid-data-path": (REFUSED, "a data path per split (use --data-path and --split)"),
    "--test-data-path": (REFUSED, "a data path per split (use --data-path and --split)"),
    "--data-args-path": (REFUSED, "data paths read from a file"),
    "--per-split-data-args-path": (REFUSED, "data paths read from a file"),
    "--no-mmap-bin-files": (NO_EFFECT, "how the .bin files are read: the same tokens"),
    "--encoder-seq-length": (REFUSED, "Megatron-LM's other name of --seq-length: use "
                                      "--seq-length"),
    "--decoder-seq-length": (REFUSED, _ENCDEC),
    "--retriever-seq-length": (REFUSED, "biencoder / ICT retrieval models"),
    "--sample-rate": (REFUSED, "subsampled training data"),
    "--mask-prob": (REFUSED, _ENCDEC),
    "--short-seq-prob": (REFUSED, _ENCDEC),
    "--no-create-attention-mask-in-dataloader": (NO_EFFECT, "the loader makes no dense mask "
                                                            "here: the kernels build it"),
    "--num-dataset-builder-threads": (NO_EFFECT, "threads that build the sample indices: "
                                                 "the same indices"),
    "--object-storage-cache-path": (NO_EFFECT, "object-storage data is not read here"),
    "--mid-level-dataset-surplus": (REFUSED, "another blended-dataset surplus"),
    "--allow-ambiguous-pad-tokens": (REFUSED, "Megatron-LM's pad-token loss masking"),
    # tokenizer
    "--padded-vocab-size": (REFUSED, "a given padded vocabulary (use "
                                     "--make-vocab-size-divisible-by)"),
    "--vocab-extra-ids": (REFUSED, _ENCDEC),
    "--tokenizer-metadata": (REFUSED, "Megatron-LM's tokenizer metadata files"),
    "--tiktoken-pattern": (NO_EFFECT, _TIKTOKEN),
    "--tiktoken-num-special-tokens": (NO_EFFECT, _TIKTOKEN),
    "--tiktoken-special-tokens": (NO_EFFECT, _TIKTOKEN),
    "--legacy-tokenizer": (NO_EFFECT, "Megatron-LM's choice between its tokenizer code paths"),
    "--trust-remote-code": (NO_EFFECT, "no Hugging Face remote code runs here"),
    # logging
    "--log-progress": (NO_EFFECT, "no progress.txt is written here; --metrics-jsonl has "
                                  "every logged iteration"),
    "--timing-log-level": (NO_EFFECT, _TIMERS),
    "--timing-log-option": (NO_EFFECT, _TIMERS),
    "--no-barrier-with-level-1-timing": (NO_EFFECT, _TIMERS),
    "--log-energy": (NO_EFFECT, "energy is not measured here"),
    "--tensorboard-queue-size": (NO_EFFECT, "TensorBoard's writer queue: when, not what"),
    "--no-log-loss-scale-to-tensorboard": (NO_EFFECT, _TB_EXTRA),
    "--log-validation-ppl-to-tensorboard": (NO_EFFECT, _TB_EXTRA),
    "--log-memory-to-tensorboard": (NO_EFFECT, "already so here: every logged record writes "
                                               "mem_allocated_gib and mem_peak_gib to "
                                               "tensorboard"),
    "--log-world-size-to-tensorboard": (NO_EFFECT, _TB_EXTRA),
    "--logging-level": (NO_EFFECT, "the log level here: INFO on rank 0, warnings elsewhere"),
    # inference: the CUDA-graph flags concern training too
    "--enable-cuda-graph": (NO_EFFECT, _CUDA_GRAPH),
    "--external-cuda-graph": (NO_EFFECT, _CUDA_GRAPH),
    "--cuda-graph-impl": (NO_EFFECT, _CUDA_GRAPH),
    "--cuda-graph-scope": (NO_EFFECT, _CUDA_GRAPH),
    "--cuda-graph-warmup-steps": (NO_EFFECT, _CUDA_GRAPH),
    # Transformer-Engine
    "--te-rng-tracker": (NO_EFFECT, "Transformer Engine's RNG tracker: dropout draws from "
                                    "torch's generators here"),
    "--inference-rng-tracker": (NO_EFFECT, "an RNG for inference; this is training"),
    # vision: its QK norms concern language models too (--qk-layernorm is ours)
    "--qk-l2-norm": (REFUSED, "Llama 4's QK L2 normalization"),
    # experimental
    "--enable-experimental": (NO_EFFECT, "Megatron-LM's experimental code paths are not here"),
    "--spec": (REFUSED, "custom Megatron-Core layer specs"),
    **{f: (REFUSED, "Mamba and hybrid models") for f in (
        "--hybrid-attention-ratio", "--hybrid-mlp-ratio", "--hybrid-override-pattern",
        "--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads",
        "--is-hybrid-model", "--disable-mamba-mem-eff-path")},
    "--yaml-cfg": (REFUSED, "YAML configs (give the flags)"),
    "--use-precision-aware-optimizer": (NO_EFFECT, "with its default fp32 main grads, weights "
                                                   "and moments, the same math as here"),
    **{f: (REFUSED, "16-bit or 8-bit optimizer states, main weights or main grads") for f in (
        "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")},
    # added to Megatron-LM's main since 000c4ac2: megatron_table_main.py
    **ADDED,
}


# Deprecated switches Megatron-LM still accepts only beside a setting (its validate_args
# stops otherwise): flag -> (config section, field, the value it needs, the flag setting
# it, what to use instead). Given beside another value, the run stops naming both.
NEEDS: dict[str, tuple[str, str, object, str, str]] = {
    "--no-position-embedding": ("model", "position_embedding_type", "rope",
                                "--position-embedding-type", "--position-embedding-type"),
}

# Values of refused flags that ask for what runs here anyway (Megatron-LM's own default
# values are accepted too): accepted and logged.
SAME_HERE: dict[str, object] = {
    "--recompute-modules": ["core_attn"],
}
