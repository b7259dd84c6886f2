"""--ds-sequence-parallel-fpdt at sp = 1 (issue 40, item 2): one rank's attention in sequence
chunks (parallel/fpdt.py, no exchange: parallel/fpdt_chunks.py), query chunks against key
chunks merged by log-sum-exp, with and without the chunks on the host. Exact against the
unchunked kernels, in one process (no spawn): the core against the math reference; a small
Llama-style GPT's loss and gradients against the same GPT without FPDT; the trainer installs
the chunked core at sp = 1 and trains as without it; a chunk that does not divide the
sequence is one line naming --ds-sequence-parallel-fpdt-chunk-size."""

import copy
import logging

import pytest
import torch

from helpers import TINY, llama_config, read_jsonl, train_losses

B, S, D = 2, 64, 16
# fp32, relative to the largest entry. Core against the math reference: measured 3.6e-7
# (worst of out, dq, dk, dv over the cases below). GPT against the unchunked model (C = 4,
# offload off and on): loss measured equal (the logits differ by 3.6e-7 of their largest),
# gradients 4.0e-7
CORE_TOL = 3e-6
GPT_TOL = 1e-5
# trainer, per step (test_fpdt_training.py's, test_parity.py's): measured equal
LOSS_RTOL = 1e-5


def _rel(a, b) -> float:
    return ((a.float() - b).abs().max() / b.abs().max()).item()


def test_core_on_one_rank_matches_math_attention():
    """Causal (the fused kernel), a window, packed documents and attention dropout (the
    block kernel), MHA and GQA, C = 2 and 4: within CORE_TOL of the math reference; offload
    bit for bit the same, everything kept for backward on the host; no collective (the comm
    has no group at all)."""
    from megaulysses.model.attention import AttentionMask, math_attention
    from megaulysses.model.attention.dropout import AttentionDropout
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.fpdt import ChunkedUlyssesAttention
    from megaulysses.parallel.host_memory import is_host
    docs = torch.tensor([[0] * 10 + [1] * 30 + [2] * 24, [0] * 40 + [1] * 24])
    drop = AttentionDropout(0.2, key=12345)
    cases = [(AttentionMask(), 4, 4, 4, 0.0), (AttentionMask(), 4, 2, 2, 0.0),
             (AttentionMask(window=12), 4, 2, 4, 0.0),
             (AttentionMask(documents=docs), 2, 1, 2, 0.0),
             (AttentionMask(), 4, 2, 4, drop)]
    for n, (mask, hq, hkv, chunks, dropout) in enumerate(cases):
        g = torch.Generator().manual_seed(n)
        q, k, v, dy = (torch.randn(B, S, h, D, generator=g) for h in (hq, hkv, hkv, hq))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = math_attention(*full, dropout, mask)
        refs = [ref.detach()] + list(torch.autograd.grad(ref, full, dy))
        runs = []
        for offload in (False, True):
            comm = Comm()
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            handed = list(ins)
            y = ChunkedUlyssesAttention(comm, chunks, offload).take(handed, dropout, mask)
            # what backward needs: with offload all on the host (none on the device)
            assert {is_host(t) for t in y.grad_fn.saved_tensors} == {offload}, n
            runs.append([y.detach()] + list(torch.autograd.grad(y, ins, dy)))
            assert handed == [] and comm.stats.pop() == {}, n
        # offload copies exactly
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True)), n
        err = max(_rel(a, b) for a, b in zip(runs[1], refs, strict=True))
        assert err < CORE_TOL, (n, err)


def _loss_and_grads(model, tokens, labels) -> tuple:
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gpt_with_chunked_attention_matches_unchunked():
    """A 2-layer Llama-style GPT (GQA 4/2), fp32, S = 64 in chunks of S/4: the same loss and
    gradients as the model's own core, with and without the chunks on the host."""
    from megaulysses.model.attention import sdpa_attention
    from megaulysses.model.gpt import build_model
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.fpdt import ChunkedUlyssesAttention, apply_fpdt
    cfg = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4,
                       num_query_groups=2, seq_length=S, vocab_size=300,
                       make_vocab_size_divisible_by=128)
    model = build_model(cfg, sdpa_attention, seed=3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (B, S), generator=g)
    labels = torch.randint(0, 300, (B, S), generator=g)
    loss, grads = _loss_and_grads(model, tokens, labels)
    for offload in (False, True):
        chunked = apply_fpdt(copy.deepcopy(model), Comm(), chunks=4, offload=offload)
        assert all(isinstance(layer.attn.core, ChunkedUlyssesAttention)
                   for layer in chunked.layers.values())
        c_loss, c_grads = _loss_and_grads(chunked, tokens, labels)
        loss_err = abs(c_loss - loss).item() / loss.item()
        grad_err = max(_rel(c_grads[n], grads[n]) for n in grads)
        assert loss_err < GPT_TOL and grad_err < GPT_TOL, (offload, loss_err, grad_err)


STEPS = ["--train-iters", "2", "--eval-iters", "0", "--lr-warmup-iters", "0"]
FPDT = ["--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size", "8",
        "--ds-sequence-parallel-fpdt-offloading"]


def test_trainer_installs_it_at_sp_1_and_trains_alike(tmp_path):
    """The trainer's own path (flags, check_fpdt, parallelize): at sp = 1 the chunked core
    (4 chunks of TINY's 32 tokens, on the host) is in every block, and two steps give one
    process's unchunked losses."""
    from megaulysses.config import parse_args
    from megaulysses.parallel.fpdt import ChunkedUlyssesAttention
    from megaulysses.training.trainer import Trainer
    before = logging.root.manager.disable
    logging.disable(logging.INFO)
    losses = {}
    try:
        for name, flags in (("plain", []), ("fpdt", FPDT)):
            path = str(tmp_path / f"{name}.jsonl")
            trainer = Trainer(parse_args(TINY + STEPS + flags + [
                "--metrics-jsonl", path, "--data-cache-path", str(tmp_path / "cache")]))
            cores = {type(m.core) for m in trainer.model.modules() if hasattr(m, "core")}
            assert (ChunkedUlyssesAttention in cores) == bool(flags), (name, cores)
            trainer.train()
            losses[name] = train_losses(read_jsonl(path))
    finally:
        logging.disable(before)
    assert sorted(losses["fpdt"]) == sorted(losses["plain"]) == [1, 2]
    for step, loss in losses["plain"].items():
        assert losses["fpdt"][step] == pytest.approx(loss, rel=LOSS_RTOL), step


def test_a_chunk_that_does_not_divide_the_sequence_is_refused(capfd):
    import pretrain_gpt
    capfd.readouterr()
    rc = pretrain_gpt.main(TINY + ["--ds-sequence-parallel-fpdt",
                                   "--ds-sequence-parallel-fpdt-chunk-size", "12"])
    _, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: --ds-sequence-parallel-fpdt-chunk-size: "), lines[0]
    assert "12 must divide --seq-length 32" in lines[0], lines[0]
