"""Megatron-LM flags that select its internals, or ask for what is already ours here:
accepted so that its scripts run as written, and each logged once, with the reason, when
a run gives it (training/run.py). Their help group is the schema's COMPAT. Megatron-LM's
many other flags are data (megatron.py, megatron_table.py): those given are in
`megatron_flags`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megaulysses.config.fields import derived, option

# Megatron-LM's other --attention-backend values, and the backend each runs as here
# (resolve maps them): fused -> torch's fused SDPA, unfused and local -> plain math.
MEGATRON_ATTENTION = {"fused": "sdpa", "unfused": "math", "local": "math"}


# Switches: (Megatron-LM's meaning, why it changes nothing here).
_SWITCHES = {
    "use_mcore_models": ("Megatron-LM's model classes",
                         "there is one GPT implementation here (megaulysses/model)"),
    "no_masked_softmax_fusion": ("Megatron-LM's unfused softmax",
                                 "the softmax runs inside the --attention-backend kernel"),
    "no_bias_dropout_fusion": ("Megatron-LM's unfused bias + dropout",
                               "no fused bias-dropout kernel here"),
    "no_persist_layer_norm": ("Megatron-LM's non-persistent LayerNorm kernel",
                              "the norms are torch code here"),
    "cross_entropy_loss_fusion": ("Megatron-LM's fused cross entropy",
                                  "the loss is always the chunked linear + cross entropy "
                                  "(never the whole logits)"),
    "overlap_grad_reduce": ("Megatron-LM's overlapped gradient reduction",
                            "the bucketed gradient reduction already overlaps the backward"),
    "manual_gc": ("Megatron-LM's manual garbage collection",
                  "Python's garbage collector runs as usual"),
    "log_throughput": ("Megatron-LM's throughput in the log line",
                       "every log line has tokens/s, TFLOP/s per device and MFU already"),
    "use_pytorch_profiler": ("Megatron-LM's torch.profiler for --profile (instead of nsys)",
                             "--profile always records a torch.profiler trace here"),
}


def _switch(name: str) -> Any:
    meaning, why = _SWITCHES[name]
    return option(False, meaning, action="store_true", no_effect=why)


@dataclass(frozen=True)
class CompatConfig:
    """Megatron-LM flags that select its internals, or behaviour that is already ours:
    accepted so its scripts run as written, each logged once when given."""
    use_mcore_models: bool = _switch("use_mcore_models")
    transformer_impl: str = option(
        "transformer_engine", "Megatron-LM's layer implementation",
        choices=("local", "transformer_engine"),
        no_effect="it selects no kernels here: the attention backend and the matmul library "
                  "in use are logged at start")
    no_masked_softmax_fusion: bool = _switch("no_masked_softmax_fusion")
    no_bias_dropout_fusion: bool = _switch("no_bias_dropout_fusion")
    no_persist_layer_norm: bool = _switch("no_persist_layer_norm")
    cross_entropy_loss_fusion: bool = _switch("cross_entropy_loss_fusion")
    overlap_grad_reduce: bool = _switch("overlap_grad_reduce")
    manual_gc: bool = _switch("manual_gc")
    log_throughput: bool = _switch("log_throughput")
    use_pytorch_profiler: bool = _switch("use_pytorch_profiler")
    distributed_backend: str = option(
        "nccl", "Megatron-LM's process-group backend", choices=("nccl", "gloo"),
        no_effect="the backend follows the device: NCCL on CUDA, gloo on CPU")
    # Megatron-LM's table flags given (megatron.py: no effect, or a refused flag's value
    # that asks for nothing), (flag, value) in its order; set by cli.parse_args
    megatron_flags: tuple = derived(())
