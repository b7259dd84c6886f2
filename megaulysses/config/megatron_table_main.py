"""Megatron-LM's flags added to its main since the 000c4ac2 table (most generated from its
config dataclasses; its "transformer configuration" group is TransformerConfig's fields):
their rows, merged into megatron_table.FLAGS, and the families of one prefix."""

from __future__ import annotations

from megaulysses.config.megatron_reasons import (NO_EFFECT, REFUSED, _FUSION, _OVERLAP,
                                                 _CKPT_FORMAT, _CUDA_GRAPH, _FSDP, _GTP, _MUP,
                                                 _MHC, _OFFLOAD)

# flag -> (status, reason), as megatron_table.FLAGS
ADDED: dict[str, tuple[str, str]] = {
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
