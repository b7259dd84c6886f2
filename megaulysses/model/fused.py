"""Fused ops: the plain formulas of the GPT, computed faster. Each is a
`torch.autograd.Function` (explicit forward and backward) whose results equal the plain
PyTorch formulation up to fp32 rounding; tests/model/test_fused_ops.py checks each one.

    linear                 fp32 matmuls on CPU through oneDNN instead of MKL (2x on AMD CPUs)
    linear_cross_entropy   output layer + per-token cross entropy by chunks of tokens: no
                           [tokens, vocab] log-probabilities, gradient or zero-filled buffers
    block_causal_attention explicit causal attention by query blocks, skipping the masked
                           half (faster than SDPA's CPU kernel for moderate lengths)
    rms_norm               RMSNorm with a hand-written backward (autograd's has ~2x the passes)

Anything else (CUDA, 16-bit, tensor subclasses) takes the plain PyTorch op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------
# Linear layers: oneDNN matmul on CPU
# ------------------------------------------------------------------------------------------


def _has_onednn_linear() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


# fp32 matmuls on CPU go to oneDNN instead of MKL: MKL picks its AVX2 kernels on AMD CPUs
# (~97 GFLOP/s per core measured on an AVX-512 EPYC), oneDNN its AVX-512 ones (~220).
# Tests switch this off to compare against F.linear.
ONEDNN_LINEAR = _has_onednn_linear()


def _onednn(a, b):
    """a @ b.T for 2-D fp32 CPU tensors. b may be any strided view (b = W.t() is free);
    a non-contiguous `a` is copied first."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def _onednn_weight_grad(dy, x):
    """dy.T @ x `[out, in]` for dy `[T, out]`, x `[T, in]`, through oneDNN.

    Its first operand must be contiguous (a transposed view is copied first), so the
    smaller of dy.T and x.T is the one transposed: for out > in, (x.T @ dy).T instead.
    """
    if dy.shape[1] > x.shape[1]:
        return _onednn(x.t().contiguous(), dy.t()).t().contiguous()
    return _onednn(dy.t().contiguous(), x.t())


def _use_onednn(x, weight) -> bool:
    # Plain tensors only: tensor subclasses (DTensor under tensor parallelism) take F.linear,
    # whose sharding rules they know.
    plain = type(x) is torch.Tensor and type(weight) in (torch.Tensor, torch.nn.Parameter)
    return (plain and ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and torch.backends.mkldnn.enabled)


class _OneDNNLinear(torch.autograd.Function):
    """y = x @ W.T (+ b); backward is two more matmuls of the same kind."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # x [T, in], weight [out, in]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # [T, out]

    @staticmethod
    def backward(ctx, dy):  # dy [T, out]
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _onednn(dy, weight.t()) if ctx.needs_input_grad[0] else None  # dy @ W
        dw = _onednn_weight_grad(dy, x) if ctx.needs_input_grad[1] else None  # dy.T @ x
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear(x, weight, bias=None):
    """F.linear, through oneDNN for fp32 on CPU (see ONEDNN_LINEAR), else F.linear itself."""
    if torch.is_autocast_enabled("cpu") or not _use_onednn(x, weight):
        return F.linear(x, weight, bias)
    y = _OneDNNLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def _matmul_t(a, b):
    """a @ b.T for the fused ops below: oneDNN where `linear` would use it."""
    return _onednn(a, b) if _use_onednn(a, b) else a @ b.t()


# ------------------------------------------------------------------------------------------
# Output layer + cross entropy
# ------------------------------------------------------------------------------------------


def _rows_per_chunk(rows: int, vocab: int, device: torch.device) -> int:
    # CPU: a chunk of ~16 MiB of fp32 logits stays in the last-level cache for the passes
    # after its matmul, and is recycled by malloc rather than faulted in afresh each step.
    # CUDA: the caching allocator makes size irrelevant; chunks only bound peak memory.
    budget = 2 ** 22 if device.type == "cpu" else 2 ** 28  # elements
    return max(1, min(rows, budget // vocab))


class _LinearCrossEntropy(torch.autograd.Function):
    """losses[i] = logsumexp(x[i] @ W.T) - (x[i] @ W.T)[labels[i]], by chunks of rows.

    The [T, V] logits never exist at once: each chunk's logits are turned into
    exp(logits - max) in place and kept for backward, where they become the logits gradient
    (softmax - one_hot) * grad in place, then feed the two matmuls.
    """

    @staticmethod
    def forward(ctx, x, weight, labels, ignore_index: int):  # x [T, h], weight [V, h]
        rows = _rows_per_chunk(x.shape[0], weight.shape[0], x.device)
        valid = labels != ignore_index  # [T]
        target = torch.where(valid, labels, 0).unsqueeze(1)  # [T, 1]; ignored rows: any id
        losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)  # [T]
        exps, sums = [], []
        for i in range(0, x.shape[0], rows):
            logits = _matmul_t(x[i:i + rows], weight).float()  # [c, V]
            # log-sum-exp by hand, in place: torch.logsumexp would allocate a [c, V] temporary
            top = logits.amax(dim=1, keepdim=True)  # [c, 1]
            picked = logits.gather(1, target[i:i + rows])  # [c, 1]
            e = logits.sub_(top).exp_()  # [c, V], exp(logits - top) in the logits' memory
            total = e.sum(dim=1, keepdim=True)  # [c, 1]
            torch.sub(total.log().add_(top), picked, out=losses[i:i + rows].unsqueeze(1))
            exps.append(e)
            sums.append(total)
        losses.masked_fill_(~valid, 0.0)
        # softmax = e / sum(e): backward folds the division into its scaling by the gradient.
        ctx.save_for_backward(x, weight, target, valid, torch.cat(sums), *exps)
        ctx.rows, ctx.grad_seen = rows, None
        return losses

    @staticmethod
    def backward(ctx, grad):  # grad [T]
        if ctx.grad_seen is None:  # turn the saved exps into d loss / d logits, in place
            x, weight, target, valid, sums, *exps = ctx.saved_tensors
            _dlogits_in_place(exps, grad, target, valid, sums, ctx.rows)
            # Kept outside saved_tensors, whose version check now refuses the exps: a second
            # backward (retain_graph; the zero-bubble schedule runs one for the inputs, one
            # for the weights) reuses them. Inputs only, no reference cycle.
            ctx.grad_seen, ctx.kept = grad.detach().clone(), (x, weight, exps)
        elif not torch.equal(grad, ctx.grad_seen):
            raise RuntimeError("linear_cross_entropy: a second backward with a different "
                               "gradient is not supported (saved logits are consumed)")
        x, weight, exps = ctx.kept
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dxs, dwt = [], None  # dx by chunks of rows; dw.T [h, V] summed over chunks
        for n, e in enumerate(exps):
            i = n * ctx.rows
            dlogits = e.to(x.dtype)  # [c, V]; a no-op in fp32
            if need_dx:
                dxs.append(_matmul_t(dlogits, weight.t()))  # dlogits @ W: [c, h]
            if need_dw:
                # x.T @ dlogits: [h, V]. (dw.T because then the operand to make contiguous
                # is x.T, the small one; see _onednn_weight_grad.)
                dwi = _matmul_t(x[i:i + ctx.rows].t().contiguous(), dlogits.t())
                dwt = dwi if dwt is None else dwt.add_(dwi)
        dx = torch.cat(dxs) if need_dx else None
        dw = dwt.t().contiguous() if need_dw else None
        return dx, dw, None, None


def _dlogits_in_place(exps, grad, target, valid, sums, rows: int):
    """exp(logits - max) chunks -> (softmax - one_hot(label)) * grad, in place."""
    g = (grad * valid).unsqueeze(1)  # [T, 1] fp32; ignored rows get no gradient
    scale = g / sums  # [T, 1]
    for n, e in enumerate(exps):
        i = n * rows
        e.mul_(scale[i:i + rows]).scatter_add_(1, target[i:i + rows], -g[i:i + rows])


def linear_cross_entropy(x, weight, labels, ignore_index: int = -100):
    """Per-token `F.cross_entropy(F.linear(x, weight).float(), labels, reduction="none")`.

    x `[..., h]`, weight `[V, h]`, labels `[...]` -> fp32 losses `[...]`; label
    `ignore_index` gives loss 0 and no gradient, as in F.cross_entropy. Under autocast the
    matmuls run in the autocast dtype (as F.linear would), the softmax always in fp32.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
    with torch.autocast(device, enabled=False):
        losses = _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight,
                                           labels.reshape(-1), ignore_index)
    return losses.view(labels.shape)


# ------------------------------------------------------------------------------------------
# Causal attention by query blocks
# ------------------------------------------------------------------------------------------


class _BlockCausalAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d), causal) v with batched matmuls, one block of queries at a time.

    Query block [i0, i1) only needs keys [0, i1): the blocks above the diagonal are never
    computed, and each row's softmax is complete within its block (no online rescaling as
    in flash attention). The probabilities are kept for backward, so backward is plain
    matmuls too. Inputs are grouped for GQA: q `[N, s * rep, d]` with rows ordered
    (position, head in group), k and v `[N, s, d]`, N = batch * kv heads.
    """

    @staticmethod
    def forward(ctx, q, k, v, rep: int, block: int):
        n, s, d = k.shape
        q = q * d ** -0.5  # scaling q (s * rep * d) is cheaper than scaling the scores
        # Row (t, head) of a diagonal block sees keys <= t: its upper triangle is masked.
        upper = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)
        upper = upper.repeat_interleave(rep, dim=0)  # [block * rep, block]
        outs, probs = [], []
        for i0 in range(0, s, block):
            i1 = min(i0 + block, s)
            r0, r1 = i0 * rep, i1 * rep
            scores = torch.bmm(q[:, r0:r1], k[:, :i1].transpose(1, 2))  # [N, (i1-i0)*rep, i1]
            scores[:, :, i0:].masked_fill_(upper[:r1 - r0, :i1 - i0], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            outs.append(torch.bmm(p, v[:, :i1]))  # [N, (i1-i0)*rep, d]
            probs.append(p)
        # (bmm into a slice of a preallocated output falls back to one matmul per batch.)
        out = torch.cat(outs, dim=1)  # [N, s * rep, d]
        ctx.save_for_backward(q, k, v, out, *probs)
        ctx.rep, ctx.block = rep, block
        return out

    @staticmethod
    def backward(ctx, dout):  # dout [N, s * rep, d]
        q, k, v, out, *probs = ctx.saved_tensors  # q is already scaled
        rep, block = ctx.rep, ctx.block
        n, s, d = k.shape
        dout = dout.contiguous()
        # Softmax backward needs rowsum(dP * P), which equals rowsum(dO * O).
        delta = (dout * out).sum(-1, keepdim=True)  # [N, s * rep, 1]
        dqs = []
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        for n_blk, i0 in enumerate(range(0, s, block)):
            i1 = min(i0 + block, s)
            r0, r1 = i0 * rep, i1 * rep
            p, do = probs[n_blk], dout[:, r0:r1]  # [N, rows, i1], [N, rows, d]
            dv[:, :i1] += torch.bmm(p.transpose(1, 2), do)
            dp = torch.bmm(do, v[:, :i1].transpose(1, 2))  # [N, rows, i1]
            ds = dp.sub_(delta[:, r0:r1]).mul_(p)  # d scores, in place
            dqs.append(torch.bmm(ds, k[:, :i1]))
            dk[:, :i1] += torch.bmm(ds.transpose(1, 2), q[:, r0:r1])
        dq = torch.cat(dqs, dim=1).mul_(d ** -0.5)  # [N, s * rep, d]
        return dq, dk, dv, None, None


def block_causal_attention(q, k, v, block: int = 64):
    """Causal attention core on `[b, s, h, d]` (GQA: hq % hkv == 0), no dropout.

    Keeps softmax probabilities of about b * hq * s^2 / 2 elements per layer for backward,
    so it is meant for moderate s; `cpu_attention` picks it.
    """
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    # q head j * rep + r belongs to kv head j (as in math_attention's repeat_interleave).
    qg = q.view(b, s, hkv, rep, d).transpose(1, 2).reshape(b * hkv, s * rep, d)
    kg = k.transpose(1, 2).reshape(b * hkv, s, d)
    vg = v.transpose(1, 2).reshape(b * hkv, s, d)
    out = _BlockCausalAttention.apply(qg, kg, vg, rep, block)  # [b * hkv, s * rep, d]
    return out.view(b, hkv, s, rep, d).transpose(1, 2).reshape(b, s, hq, d)


# ------------------------------------------------------------------------------------------
# RMSNorm
# ------------------------------------------------------------------------------------------


class _RMSNorm(torch.autograd.Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), with a hand-written backward:

    dx = rstd * (g*w - x_hat * mean(g*w * x_hat)),  dw = sum over tokens of g * x_hat.

    (nn.RMSNorm's forward is fused, but its backward is autograd's composite formula,
    about twice the passes and temporaries.)
    """

    @staticmethod
    def forward(ctx, x, weight, eps: float):  # x [..., h], weight [h]
        sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()  # sum(x^2) [..., 1]
        rstd = sq.div_(x.shape[-1]).add_(eps).rsqrt_()  # [..., 1]
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, weight, rstd)
        return x_hat * weight

    @staticmethod
    def backward(ctx, grad):
        x_hat, weight, rstd = ctx.saved_tensors
        dw = (grad * x_hat).sum(dim=tuple(range(grad.dim() - 1)))  # [h]
        gw = grad * weight
        dot = (gw * x_hat).mean(dim=-1, keepdim=True)  # [..., 1]
        dx = gw.addcmul_(x_hat, dot, value=-1).mul_(rstd)
        return dx, dw, None


def rms_norm(x, weight, eps: float):
    """F.rms_norm(x, (h,), weight, eps) over the last dim; fused for fp32 inputs."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm.apply(x, weight, eps)

