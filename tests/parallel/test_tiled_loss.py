"""The vocab-parallel chunked output layer + cross entropy on 2 gloo ranks == one process.

`vocab_parallel_linear_cross_entropy` of parallel/tensor.py (each rank: half the vocabulary
rows of W) against the plain `F.cross_entropy(F.linear(x, W).float(), labels)`: losses, dx
and this rank's rows of dW, fp32 within FP32_TOL of the largest reference magnitude, for
ragged, even and single chunks, with the input replicated (dx all-reduced inside) and as
Megatron-SP sequence shards (gathered inside; dx reduce-scattered); under bf16 autocast
within BF16_TOL. The bytes its collectives send match the formula. Then the whole GPT under
`apply_tensor_parallel` (tied and untied output layer, with and without Megatron-SP, and
with the tiled MLP under Megatron-SP): losses and every parameter gradient == one process.
"""

import torch

from dist import run_ranks
from helpers import llama_config

FP32_TOL = 1e-5
BF16_TOL = 3e-2
B, S, H, V = 2, 24, 16, 96  # T = 48 tokens
ROWS = [5, 16, 1000]  # ragged chunks, even chunks, one chunk (its exps kept)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 0] = labels[1, 7] = -100  # ignored: loss 0, no gradient
    grad = torch.rand(B, S, generator=g)  # non-uniform incoming gradient
    return x, w, labels, grad


def _plain(x, w, labels, grad):
    import torch.nn.functional as F
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    losses = F.cross_entropy(F.linear(x, w).float().flatten(0, 1), labels.flatten(),
                             reduction="none").view(labels.shape)
    return (losses, *torch.autograd.grad(losses, (x, w), grad))


def vocab_parallel_op(rank, world):
    from megaulysses.model.ops import cross_entropy
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import TP, ParallelDims, build_mesh
    from megaulysses.parallel.tensor import vocab_parallel_linear_cross_entropy
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=world, pp=1, sp=1), "cpu"))
    x, w, labels, grad = _inputs()
    vocab = slice(rank * V // world, (rank + 1) * V // world)  # this rank's rows of W
    seq = slice(rank * S // world, (rank + 1) * S // world)  # its sequence shard (SP)
    out = {}
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ref = _plain(x, w, labels, grad)
            for rows in ROWS if not autocast else [16]:
                cross_entropy._rows_per_chunk = lambda *_, rows=rows: rows
                for sp in (False, True):
                    xl = (x[:, seq] if sp else x).clone().requires_grad_()
                    wl = w[vocab].clone().requires_grad_()
                    losses = vocab_parallel_linear_cross_entropy(
                        xl, wl, labels, comm, TP, gather_dim=1 if sp else None)
                    dx, dw = torch.autograd.grad(losses, (xl, wl), grad)
                    err = max(_rel(losses, ref[0]), _rel(dx, ref[1][:, seq] if sp else ref[1]),
                              _rel(dw, ref[2][vocab]))
                    out[(autocast, rows, sp)] = (err, comm.stats.pop())
    return out


def test_vocab_parallel_op_matches_one_process():
    t = B * S
    for result in run_ranks(vocab_parallel_op, 2):
        for (autocast, rows, sp), (err, sent) in result.items():
            assert err < (BF16_TOL if autocast else FP32_TOL), (autocast, rows, sp, err)
            # Forward: per chunk an all-reduce of the row maxima [c] and of (sums, picked
            # logits) [2, c], fp32: 2 * 3T * 4 * (P-1)/P bytes in all. Backward: dx [T, h]
            # all-reduced, or with SP the gather of x and its reduce-scatter (16-bit under
            # autocast: x is cast before it is gathered).
            x_bytes = t * H * (2 if autocast else 4)
            want = {"all_reduce": 3 * t * 4}
            if sp:
                want.update(all_gather=x_bytes // 2, reduce_scatter=x_bytes // 2)
            else:
                want["all_reduce"] += x_bytes
            assert sent == want, (autocast, rows, sp, sent)


GPT_CASES = {"tied-tp2": (True, False, 1), "tied-tp2-megatron-sp": (True, True, 1),
             "untied-tp2-megatron-sp": (False, True, 1),
             "tied-tp2-megatron-sp-tiled-mlp": (True, True, 4)}  # tied, SP, MLP chunks


def gpt_tp(rank, world):
    from megaulysses.model.attention import math_attention
    from megaulysses.model.gpt import build_model
    from megaulysses.model.ops import cross_entropy
    from megaulysses.model.tiling import apply_tiled_mlp
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import TP, ParallelDims, build_mesh
    from megaulysses.parallel.tensor import align_grads, apply_tensor_parallel, step_context
    cross_entropy._rows_per_chunk = lambda *_: 20  # 64 tokens: ragged chunks
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=world, pp=1, sp=1), "cpu"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    labels = tokens.roll(-1, dims=1)
    labels[0, 3] = -100
    grad = torch.rand(2, 32, generator=g)
    out = {}
    for case, (tied, sequence_parallel, mlp_chunks) in GPT_CASES.items():
        cfg = llama_config(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=32,
                          vocab_size=128, untie_embeddings_and_output_weights=not tied)
        ref = build_model(cfg, math_attention, seed=2)
        ref_losses = ref(tokens, labels=labels)
        ref_losses.backward(grad)
        model = apply_tensor_parallel(build_model(cfg, math_attention, seed=2),
                                      comm.mesh(TP), sequence_parallel, comm)
        apply_tiled_mlp(model, mlp_chunks)  # per chunk: SP's all-gather, reduce-scatter
        with step_context(comm):
            losses = model(tokens, labels=labels)
            losses.backward(grad)
        align_grads(model.parameters(), comm)
        errs = {"losses": _rel(losses, ref_losses)}
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            gp = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            errs[name] = _rel(gp, q.grad)
        out[case] = errs
    return out


def test_gpt_vocab_parallel_head_matches_one_process():
    for result in run_ranks(gpt_tp, 2):
        assert result.keys() == GPT_CASES.keys()
        for case, errs in result.items():
            assert max(errs.values()) < FP32_TOL, (case, errs)
