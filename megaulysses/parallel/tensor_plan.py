"""Tensor parallelism's plan as a table, without torch.distributed: tensor.py applies it,
the memory plan sizes each rank's parameters by it (--dry-run and tools/plan.py import
this, not DTensor).

In the order parallelize_module applies it: a block's linears, column-parallel (weight and
bias split by rows, dim 0) or row-parallel (weight split by columns, dim 1; bias whole;
partial sums reduced), mlp.gate where the block has one (SwiGLU); and the vocab-parallel
embedding and output layer (rows split). Everything else is replicated.
"""

BLOCK_LINEARS = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise",
                 "attn.out": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise",
                 "mlp.gate": "colwise"}
VOCAB_PARALLEL = ("embed.word", "head.output")


def megatron_sp_bytes_per_layer(b: int, s: int, h: int, tp: int, element_size: int) -> dict:
    """Forward bytes one rank sends per transformer layer under Megatron-SP (backward sends
    the same, the kinds swapped): an all-gather of the `[b, s, h]` activations before
    attention and before the MLP, a reduce-scatter after each."""
    n = b * s * h * element_size * (tp - 1) // tp
    return {"all_gather": 2 * n, "reduce_scatter": 2 * n}
