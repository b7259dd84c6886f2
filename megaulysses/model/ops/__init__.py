"""Fused ops: the plain formulas of the GPT, computed faster. Each is a
`torch.autograd.Function` (explicit forward and backward) whose results equal the plain
PyTorch formulation up to fp32 rounding; tests/model/test_fused_ops.py checks each one.

    linear                 fp32 matmuls on CPU through oneDNN instead of MKL (2x on AMD CPUs)
                           (onednn.py)
    linear_cross_entropy   output layer + per-token cross entropy by chunks of tokens,
                           recomputed in backward: never more than one chunk of
                           [tokens, vocab] logits or gradient, in any dtype; the same math
                           serves the vocab-parallel loss of parallel/tensor.py
                           (cross_entropy.py)
    rms_norm               RMSNorm with a hand-written backward (autograd's has ~2x the passes)
                           (norms.py)

Otherwise (CUDA, 16-bit, tensor subclasses) linear and rms_norm take the plain PyTorch op;
the cross entropy runs chunked everywhere. The switch `ONEDNN_LINEAR` is state of
onednn.py, read there: set it on that module (not re-exported here, where setting it
would change nothing).
"""

from megaulysses.model.ops.cross_entropy import VocabShard, linear_cross_entropy
from megaulysses.model.ops.norms import rms_norm
from megaulysses.model.ops.onednn import linear

__all__ = ["linear", "linear_cross_entropy", "VocabShard", "rms_norm"]
