"""The reasons megatron_table.py and megatron_table_main.py give, shared by both."""

NO_EFFECT, REFUSED = "no effect", "refused"

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
