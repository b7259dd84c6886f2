"""Gradient-accumulation fusion (Megatron-LM's default) and its gradient buffer's dtype
under the distributed optimizer (parallel/dist_opt.py, model/fused_linear.py).

1. The main gradient. One linear layer (37 x 24: rows split unevenly over dp 2) under
   bf16 autocast, 4 micro-batches on each of 2 gloo ranks: the fused path's main gradient
   (this rank's rows after the reduce-scatter) against the exact sum (fp64) of the 16-bit
   per-micro-batch products g^T x -- what Megatron-LM's fp32-accumulating kernel computes
   -- and the unfused path's. Fused: within fp32 summation error (bound: 1e-6 relative to
   the sum of |products|, ~8 fp32 ulps); unfused: each micro-batch's gradient was rounded
   to bf16 first (2^-9 relative), so it must be farther, by orders of magnitude. No
   `.grad` exists after any fused micro-batch, and the bucket's reduce-scatter starts in
   the last backward (not at `finish`), also where each forward uses the weight twice
   under a non-reentrant checkpoint (its forward repeated in backward). Bytes: one
   backward of a 512 x 512 linear allocates its 512 KiB bf16 weight gradient unfused,
   under 64 KiB fused (the live-bytes tracker).
2. Training (2 ranks, 4 micro-batches each, 3 steps): fused and unfused losses within the
   dtype matrix's bf16 tolerances (tests/parallel/test_dtype_matrix.py: 5e-5 loss,
   1.5e-3 gradient norm, relative) under --bf16 and --fp16; fp32 runs equal exactly (the
   fusion is a distributed-optimizer thing, which fp32 runs do not have). The fused path's
   bucket counting (a bucket is reduce-scattered when its weights' last use is in) is
   held exactly: tiny buckets with --overlap-param-gather, and a tiled MLP (several uses
   of a weight per backward) under full recomputation (forwards repeated in backward),
   each equal to the one-bucket run bit for bit.
3. The buffer's dtype, Megatron-LM's: fp32 under --bf16, bf16 with --grad-reduce-in-bf16,
   fp16 under --fp16 unless --accumulate-allreduce-grads-in-fp32.
"""

import pytest

from dist import run_ranks
from helpers import TINY, read_jsonl

MICRO, ROWS, COLS, TOKENS = 4, 37, 24, 16


def main_gradients(rank, world) -> dict:
    """{path: (max |main - exact|, scale, .grad seen, reduced during backward)} of this
    rank's rows."""
    import torch
    from torch.utils.checkpoint import checkpoint
    from megaulysses.model.layers import Linear
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import ParallelDims, build_mesh
    from megaulysses.parallel.dist_opt import DistributedOptimizer
    comm = Comm(build_mesh(ParallelDims(dp=world, tp=1, pp=1, sp=1), "cpu"))
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(ROWS, COLS, generator=gen)
    data = [[(torch.randn(TOKENS, COLS, generator=gen), torch.randn(TOKENS, ROWS, generator=gen))
             for _ in range(MICRO)] for _ in range(world)]  # per rank, per micro-batch
    # the exact sum of every rank's 16-bit products (bf16 x bf16 is exact in fp64)
    exact = sum(c.bfloat16().double().t() @ x.bfloat16().double()
                for rank_data in data for x, c in rank_data)  # [ROWS, COLS]
    out = {}
    for path in ("fused", "fused-twice-recomputed", "unfused"):
        fused = path != "unfused"
        layer = Linear(COLS, ROWS, bias=False)
        with torch.no_grad():
            layer.weight.copy_(w0)
        opt = DistributedOptimizer([{"params": [layer.weight]}], comm, torch.bfloat16,
                                   torch.float32, 2 ** 20, lambda g: torch.optim.AdamW(g))
        if fused:
            opt.fuse_weight_gradients(layer)
        grad_seen = False
        for m, (x, c) in enumerate(data[rank]):
            if m == MICRO - 1:
                opt.arm()
            with torch.autocast("cpu", torch.bfloat16):
                if path == "fused-twice-recomputed":
                    y = checkpoint(lambda a, layer=layer: torch.cat([layer(a[:TOKENS // 2]),
                                                        layer(a[TOKENS // 2:])]),
                                   x, use_reentrant=False)
                else:
                    y = layer(x)  # [T, ROWS] bf16; dloss/dy = c rounded to bf16
            (y.float() * c).sum().backward()
            grad_seen |= layer.weight.grad is not None
        early = opt.buckets[0].work is not None
        opt.finish()
        shard = opt.shards[layer.weight]
        mine = exact[shard.lo:shard.hi]
        err = (opt.main_grads[layer.weight].double() - mine).abs().max().item()
        scale = sum((c.bfloat16().double().t() @ x.bfloat16().double()).abs()
                    for rank_data in data for x, c in rank_data)[shard.lo:shard.hi].max().item()
        out[path] = (err, scale, grad_seen, early)
    return out


def test_fused_main_gradient_is_the_fp32_sum_of_16bit_products():
    for rank in run_ranks(main_gradients, 2):
        unfused = rank["unfused"][0]
        for path in ("fused", "fused-twice-recomputed"):
            fused, scale, grad_seen, early = rank[path]
            print(f"max |main gradient - exact sum|: {path} {fused:.3e}, unfused "
                  f"{unfused:.3e} (largest sum of |products| {scale:.1f})")
            assert fused <= 1e-6 * scale  # fp32 summation only
            assert unfused > 100 * fused  # each micro-batch rounded to bf16 first
            assert not grad_seen  # no 16-bit .grad per micro-batch
            assert early  # reduce-scattered as soon as the last use was in
        assert rank["unfused"][3]  # the autograd hook's path overlaps too


def backward_peak(fused: bool) -> int:
    """Peak live bytes allocated in one micro-batch's backward of a 512 x 512 bf16 linear
    on 8 tokens (one process): the unfused path's 16-bit weight gradient is 512 KiB, the
    fused path's fp32 copies of its operands 2 x 16 KiB."""
    import torch
    from megaulysses.model.layers import Linear
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dist_opt import DistributedOptimizer
    from megaulysses.training.live_bytes import LiveBytes
    layer = Linear(512, 512, bias=False)
    opt = DistributedOptimizer([{"params": [layer.weight]}], Comm(), torch.bfloat16,
                               torch.float32, 2 ** 30, lambda g: torch.optim.AdamW(g))
    if fused:
        opt.fuse_weight_gradients(layer)
    x = torch.randn(8, 512)
    with torch.autocast("cpu", torch.bfloat16):
        loss = layer(x).float().sum()
    with LiveBytes() as mem:
        loss.backward()
    return mem.peak


def test_fused_backward_allocates_no_16bit_weight_gradient():
    fused, unfused = backward_peak(True), backward_peak(False)
    print(f"peak bytes allocated in backward: fused {fused}, unfused {unfused}")
    assert unfused >= 512 * 512 * 2  # the bf16 weight gradient, at least
    assert fused <= 64 * 1024  # operands' fp32 copies and the input gradient only


STEPS = ["--train-iters", "3", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "512", "--use-distributed-optimizer"]
OFF = ["--no-gradient-accumulation-fusion"]
TINY_BUCKETS = ["--ddp-bucket-size", "1", "--overlap-param-gather"]
TILED = ["--tiled-mlp-chunks", "2", "--recompute-granularity", "full",
         "--recompute-method", "uniform", "--recompute-num-layers", "1"]
FP16 = ["--fp16", "--loss-scale", "64"]
RUNS = {"bf16-unfused": ["--bf16"] + OFF, "bf16-fused": ["--bf16"],
        "bf16-fused-tiny-buckets": ["--bf16"] + TINY_BUCKETS,
        "bf16-fused-tiled": ["--bf16"] + TILED,
        "bf16-fused-tiled-tiny-buckets": ["--bf16"] + TILED + TINY_BUCKETS,
        "fp32-unfused": OFF, "fp32-fused": [],
        "fp16-unfused": FP16 + OFF, "fp16-fused": FP16,
        "bf16-grad-bf16": ["--bf16", "--grad-reduce-in-bf16"],
        "fp16-fp32-buffer": FP16 + ["--accumulate-allreduce-grads-in-fp32"]}
# the dtype matrix's bf16 tolerances (tests/parallel/test_dtype_matrix.py), relative
LOSS_RTOL, GRAD_NORM_RTOL = 5e-5, 1.5e-3


def train_all(rank, world, runs) -> list:
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    dtypes = []
    for args in runs:
        trainer = Trainer(parse_args(args))
        opt = trainer.optimizer
        dtypes.append(str(opt.buckets[0].grads.dtype) if hasattr(opt, "buckets") else None)
        trainer.train()
    return dtypes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grad_fusion")
    base = TINY + STEPS + ["--data-cache-path", str(tmp / "cache")]
    jobs = [base + flags + ["--metrics-jsonl", str(tmp / f"{name}.jsonl")]
            for name, flags in RUNS.items()]
    dtypes = dict(zip(RUNS, run_ranks(train_all, 2, jobs)[0], strict=True))
    return {name: [(r["loss"], r["grad_norm"]) for r in read_jsonl(tmp / f"{name}.jsonl")
                   if "grad_norm" in r] for name in RUNS}, dtypes


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fused_training_matches_unfused(runs, dtype):
    steps, _ = runs
    fused, unfused = steps[f"{dtype}-fused"], steps[f"{dtype}-unfused"]
    assert len(fused) == 3
    assert fused != unfused  # the fusion ran: other roundings
    for (loss, norm), (loss0, norm0) in zip(fused, unfused, strict=True):
        assert loss == pytest.approx(loss0, rel=LOSS_RTOL)
        assert norm == pytest.approx(norm0, rel=GRAD_NORM_RTOL)


def test_fp32_runs_are_identical(runs):
    steps, _ = runs
    assert len(steps["fp32-fused"]) == 3 and steps["fp32-fused"] == steps["fp32-unfused"]


@pytest.mark.parametrize("case", ["bf16-fused-tiny-buckets", "bf16-fused-tiled-tiny-buckets"])
def test_fused_buckets_reduce_once_every_use_is_in(runs, case):
    steps, _ = runs
    assert steps[case] == steps[case.replace("-tiny-buckets", "")]


def test_gradient_buffer_dtype_is_megatron_lms(runs):
    _, dtypes = runs
    assert dtypes["bf16-fused"] == "torch.float32"
    assert dtypes["bf16-grad-bf16"] == "torch.bfloat16"
    assert dtypes["fp16-fused"] == dtypes["fp16-unfused"] == "torch.float16"
    assert dtypes["fp16-fp32-buffer"] == "torch.float32"
    assert dtypes["fp32-fused"] is None  # fp32: ZeRO-1, no buffer
