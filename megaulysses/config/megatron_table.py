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

NO_EFFECT, REFUSED = "no effect", "refused"

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

_FUSION = "a Megatron-LM kernel fusion: torch's kernels run here, with the same math"
_OVERLAP = "Megatron-LM's communication overlap or bucketing: when bytes move, not what"
_NCCL = "an NCCL or network setting of Megatron-LM's: the device picks the backend here"
_TP_OVERLAP = ("Transformer Engine's overlap of tensor-parallel communication with GEMMs: "
               "same math, not done here")
_CKPT_FORMAT = ("Megatron-LM's checkpoint formats: checkpoints here have one format; "
                "tools/convert_checkpoint.py converts")
_CUDA_GRAPH = "CUDA graphs: a kernel-launch optimisation, same math; not captured here"
_GC = "Python's garbage collector runs as usual here"
_TB_EXTRA = "a TensorBoard extra of Megatron-LM's, not written here"
_TIMERS = ("Megatron-LM's timers; --log-timers-to-tensorboard times forward, backward, "
           "optimizer and each collective here")
_TIKTOKEN = "a setting of TikTokenizer, which is not provided here; unused by the others"
_GONE = "no longer valid in Megatron-LM either"
_FSDP = "Megatron-FSDP (--zero-stage 3 is FSDP2 here)"
_LOCAL_CKPT = "non-persistent (local) checkpoints and their replication"
_CP_COMM = ("other context-parallel communication (here --ds-sequence-parallel-size is the "
            "all-to-all and --context-parallel-size the ring)")
_WSD = "the WSD learning-rate schedule"
_DECAY_SCHEDULE = "a weight-decay schedule"
_ENCDEC = "encoder-decoder (T5) and BERT models"
_GTP = "generalized tensor-parallel (GTP) weight sharding"
_MUP = "the maximal update parametrization (MuP)"
_MHC = "manifold-constrained hyper-connections (mHC)"
_OFFLOAD = "fine-grained activation offloading"

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
    # ---- added to Megatron-LM's main since 000c4ac2, most from its config dataclasses
    # (its "transformer configuration" group is TransformerConfig's fields); the families
    # of one prefix are in PREFIXES
    "--tensor-parallel-num-weight-shards": (REFUSED, _GTP),
    "--max-seqlen-per-dp-cp-rank": (REFUSED, "hybrid context parallelism"),
    "--hybrid-context-parallel": (REFUSED, "hybrid context parallelism"),
    **{f: (REFUSED, "mixture of experts") for f in (
        "--expert-model-parallel-size", "--expert-tensor-parallel-size",
        "--expert-tensor-parallel-num-weight-shards", "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute", "--overlap-dispatch-backward-with-experts-wgrad",
        "--ep-overlap-early-attn-memory-release", "--use-grouped-gemm-for-shared-expert")},
    "--high-priority-a2a-comm-stream": (NO_EFFECT, "a CUDA stream priority: speed only"),
    "--cpu-offloading-retain-pinned-cpu-buffers": (REFUSED, "pinned host buffers kept between "
                                                            "iterations"),
    "--flash-attention-version": (NO_EFFECT, "which FlashAttention generation a kernel comes "
                                             "from: a kernel choice (--attention-backend "
                                             "picks the kernel here)"),
    **{f: (REFUSED, "QK-clip") for f in ("--qk-clip", "--qk-clip-alpha", "--qk-clip-threshold")},
    "--attention-output-gate": (REFUSED, "gated attention outputs"),
    "--experimental-attention-variant": (REFUSED, "other attention variants (DSA, gated delta "
                                                  "net)"),
    "--linear-attention-freq": (REFUSED, "linear-attention layers"),
    "--use-mup": (REFUSED, _MUP),
    "--fused-residual-rmsnorm": (NO_EFFECT, _FUSION),
    "--use-transformer-engine-op-fuser": (NO_EFFECT, _FUSION),
    "--no-fp8-wgrad": (REFUSED, "FP8 / FP4 training"),
    **{f: (REFUSED, "FP8 / FP4 training") for f in (
        "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
        "--num-layers-at-end-in-bf16")},
    **{f: (REFUSED, "kitchen quantization") for f in (
        "--use-kitchen-attention", "--kitchen-attention-backend")},
    "--use-grouped-gemm-for-dense-mlp": (REFUSED, "Transformer Engine's grouped-GEMM MLP (its "
                                                  "own weight layout)"),
    "--enable-mhc-connections": (REFUSED, _MHC),
    "--config-logger-dir": (NO_EFFECT, "Megatron-LM's config dump; the start-up log prints "
                                       "every setting here"),
    "--flash-decode": (REFUSED, "Megatron-LM's inference engine"),
    "--symmetric-ar-type": (REFUSED, "Megatron-LM's inference engine"),
    "--nccl-all-reduce-for-prefill": (REFUSED, "Megatron-LM's inference engine"),
    "--mlp-chunks-for-prefill": (REFUSED, "Megatron-LM's inference engine"),
    **{f: (REFUSED, "batch-invariant kernels") for f in (
        "--batch-invariant-mode", "--batch-invariant-backend")},
    **{f: (REFUSED, _OFFLOAD) for f in (
        "--fine-grained-activation-offloading", "--offload-modules",
        "--min-offloaded-tensor-size", "--delay-offload-until-cuda-graph",
        "--delta-offload-bytes-across-pp-ranks", "--activation-offload-fraction",
        "--fine-grained-offloading-max-inflight-offloads")},
    **{f: (REFUSED, "YaRN as --position-embedding-type yarn (here: --rope-type yarn)")
       for f in ("--yarn-original-max-position-embeddings",
                 "--yarn-correction-range-round-to-int",
                 "--no-yarn-correction-range-round-to-int")},
    "--apply-wd-to-qk-layernorm": (REFUSED, "weight decay on the QK layernorm weights"),
    "--no-weight-decay-cond-type": (REFUSED, "another weight-decay condition"),
    **{f: (REFUSED, "the Lion optimizer") for f in ("--lion-beta1", "--lion-beta2")},
    **{f: (REFUSED, "other torch.profiler recordings (shapes, call stacks, Chakra traces)")
       for f in ("--pytorch-profiler-collect-shapes", "--pytorch-profiler-collect-callstack",
                 "--pytorch-profiler-collect-chakra")},
    **{f: (REFUSED, "NVTX ranges for Nsight Systems") for f in (
        "--record-shapes", "--nvtx-ranges")},
    "--step-batch-size-schedule": (REFUSED, "a step-wise batch-size schedule (here: "
                                            "--rampup-batch-size)"),
    "--gpu-sniff-test-interval": (REFUSED, "GPU performance tests between steps"),
    "--exit-signal": (REFUSED, "another exit signal than SIGTERM"),
    "--exit-signal-handler-for-dataloader": (REFUSED, "a signal handler in the data-loader "
                                                      "workers"),
    "--exit-signal-handler-for-training": (REFUSED, "stopping on SIGINT"),
    "--optimizer-cuda-graph": (NO_EFFECT, _CUDA_GRAPH),
    "--freeze-all-layers": (REFUSED, "frozen layers"),
    **{f: (REFUSED, "dumps of parameters, activations, gradients or routing between "
                    "checkpoints") for f in (
        "--save-params-interval", "--save-activations-interval",
        "--save-tokens-per-expert-interval", "--save-wgrads-interval",
        "--save-dgrads-interval")},
    **{f: (NO_EFFECT, "how Megatron-LM's asynchronous save runs (its strategy, process "
                      "priorities, staging): what it saves is the same; --async-save here")
       for f in ("--async-strategy", "--async-ckpt-cpu-priority", "--async-ckpt-io-priority",
                 "--async-ckpt-use-cpu-shm")},
    **{f: (NO_EFFECT, _CKPT_FORMAT) for f in (
        "--ckpt-fully-parallel-load-exchange-algo", "--ckpt-fully-parallel-load-per-rank-objects",
        "--ckpt-fully-parallel-save-process-group", "--ckpt-fully-parallel-load-process-group",
        "--ckpt-pg-tensors-cache-path", "--ckpt-pg-tensors-cache-create",
        "--no-ckpt-load-validate-sharding-integrity", "--dist-ckpt-workers",
        "--ckpt-drop-redundant-extra-state")},
    "--no-save-tokenizer-assets": (REFUSED, "checkpoints without the tokenizer's files"),
    "--verify-integrity": (REFUSED, "checkpoint file hashes"),
    "--override-ckpt-iteration": (REFUSED, "another iteration than the checkpoint's"),
    "--output-logit-dtype": (REFUSED, "another dtype for the output layer's GEMM"),
    "--mamba-training-ssm-states-dtype": (REFUSED, "Mamba and hybrid models"),
    "--disable-jit-fuser": (NO_EFFECT, "Megatron-LM's TorchScript fuser: no JIT-fused kernels "
                                       "here"),
    "--ddp-param-name-patterns-for-fp32-local-accumulation": (REFUSED, "fp32 local gradient "
                                                                       "accumulation of chosen "
                                                                       "parameters"),
    **{f: (REFUSED, _FSDP) for f in (
        "--megatron-fsdp-version", "--fsdp-manual-registration", "--outer-dp-sharding-strategy",
        "--fsdp-db-use-persist-buf-on-alloc-fail", "--no-use-layer-wise-param-layout")},
    "--create-all-gather-group": (NO_EFFECT, _OVERLAP),
    "--fake-process-group": (REFUSED, "fake process groups (no communication)"),
    "--start-eval-at-iter": (REFUSED, "evaluation from a chosen iteration"),
    "--eval-global-batch-size": (REFUSED, "another batch size for evaluation"),
    "--eval-micro-batch-size": (REFUSED, "another batch size for evaluation"),
    "--validation-set-names": (REFUSED, "several validation sets"),
    "--phase-transition-iterations": (REFUSED, "data phases"),
    "--per-dataset-sequences-path": (NO_EFFECT, "precomputed sequence counts that speed up "
                                                "building the indices: the same indices"),
    "--dataloader-fast-cache-load": (NO_EFFECT, "how the cached indices are loaded: the same "
                                                "samples"),
    "--dataloader-defer-npy-index-mmap": (NO_EFFECT, "when the cached indices are mapped: the "
                                                     "same samples"),
    "--dataloader-inter-document-masking": (REFUSED, "attention and positions reset at the "
                                                     "dataset's document boundaries (here: "
                                                     "--reset-attention-mask "
                                                     "--reset-position-ids, at end-of-document "
                                                     "tokens)"),
    "--no-pad-vocab-size": (REFUSED, "an unpadded vocabulary (here: "
                                     "--make-vocab-size-divisible-by 1)"),
    "--tokenizer-special-tokens": (REFUSED, "special tokens added to the tokenizer"),
    "--tokenizer-sentencepiece-legacy": (REFUSED, "the legacy SentencePiece wrapper"),
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": (REFUSED, "SentencePiece keeping "
                                                                       "extra whitespace"),
    "--tokenizer-hf-no-use-fast": (REFUSED, "transformers' slow tokenizers"),
    "--null-tokenizer-eod-id": (REFUSED, "another NullTokenizer end-of-document id"),
    "--null-tokenizer-pad-id": (REFUSED, "a NullTokenizer pad id (masked from the loss)"),
    "--chat-template": (REFUSED, "chat templates"),
    "--use-gigatoken": (REFUSED, "the gigatoken tokenizer implementation"),
    "--log-memory-interval": (REFUSED, "a memory report every N iterations"),
    "--log-device-memory-used": (REFUSED, "nvidia-smi's memory in the log"),
    "--log-max-attention-logit": (REFUSED, "the largest attention logit in TensorBoard"),
    "--hybrid-layer-pattern": (REFUSED, "Mamba and hybrid models"),
}

# flag prefix -> (status, reason), for the families added since 000c4ac2 (a FLAGS row
# wins, then these, then the group's)
PREFIXES: dict[str, tuple[str, str]] = {
    "--moe-": (REFUSED, "mixture of experts"),
    "--mtp-": (REFUSED, "multi-token prediction"),
    "--fp8-": (REFUSED, "FP8 / FP4 training"),
    "--fp4-": (REFUSED, "FP8 / FP4 training"),
    "--dsa-": (REFUSED, "DeepSeek sparse attention (DSA)"),
    "--no-dsa-": (REFUSED, "DeepSeek sparse attention (DSA)"),
    "--linear-": (REFUSED, "gated delta net (linear attention) layers"),
    "--gdp-": (REFUSED, "Mamba and hybrid models"),
    "--mup-": (REFUSED, _MUP),
    "--mhc-": (REFUSED, _MHC),
    "--muon-": (REFUSED, "the Muon optimizer"),
    "--gtp-": (REFUSED, _GTP),
    "--inference-": (REFUSED, "Megatron-LM's inference engine"),
    "--megatron-fsdp-": (REFUSED, _FSDP),
    "--fim-": (REFUSED, "fill-in-the-middle (FIM) data"),
    "--flight-recorder-": (NO_EFFECT, "NCCL's flight-recorder dumps on a hang are torch's: "
                                      "set TORCH_NCCL_TRACE_BUFFER_SIZE and "
                                      "TORCH_NCCL_DUMP_ON_TIMEOUT in the environment here"),
    "--no-flight-recorder-": (NO_EFFECT, "NCCL's flight-recorder dumps on a hang are torch's: "
                                         "set TORCH_NCCL_* in the environment here"),
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
