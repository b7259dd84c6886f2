"""--attention-head-groups G (parallel/head_groups.py) changes what backward keeps, never
what a step computes.

Training: the tiny Llama-style model of tests/helpers.py (4 heads; GQA 4/2, where sp2
leaves one kv head a rank, so k and v are exchanged whole; MHA with --num-query-groups 4,
where k and v are grouped like q), fp32, dropout 0, 4 steps of 4 samples. Every grid runs
without and with G = 2 in the same ranks (one spawn per world size) and both must give
the one-process losses within LOSS_RTOL (test_parity.py's tolerance). Grids: Ulysses sp2
(GQA and MHA), sp2 with full recomputation, sp2 with selective recomputation, sp2 at
ZeRO-3, tp2, pp2, and Ulysses x ring (sp2 x cp2) with full recomputation.

Attention alone (the world-2 spawn, each rank's own shard; and one process for the local
grouping at sp 1): grouped == ungrouped, forward and backward, for MHA, GQA with kv
grouped, kv whole and kv repeated (P a multiple of the kv heads), on several cores; each
group's core runs once forward and once recomputed (no third run under selective), none
recomputed without grad; q, k, v handed over are taken (`take` empties the list).
Dropout: the groups' recomputation replays the RNG (bit-identical gradients to the same
groups without checkpoints; whole training runs with dropout bit-identical with and
without full recomputation).
"""

import logging

import pytest
import torch

from dist import run_ranks
from helpers import TINY, read_jsonl, run_inprocess, train_losses

LOSS_RTOL = 1e-5  # test_parity.py: fp32, relative, per step
FP32_TOL = 1e-6  # attention alone: relative to the largest entry (sums reordered only)
STEPS = ["--train-iters", "4", "--eval-iters", "0", "--lr-warmup-iters", "0"]
G2 = ["--attention-head-groups", "2"]
MHA = ["--num-query-groups", "4"]
SP2, TP2 = ["--ds-sequence-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]
FULL = ["--recompute-granularity", "full"]
STYLES = {"gqa": [], "mha": MHA}
GRIDS = {  # world -> {name: (style, flags)}
    2: {"sp2 GQA (kv whole)": ("gqa", SP2),
        "sp2 MHA (kv grouped)": ("mha", SP2),
        "sp2 full recompute": ("gqa", SP2 + FULL),
        "sp2 selective recompute": ("mha", SP2 + ["--recompute-activations"]),
        "sp2 ZeRO-3": ("mha", SP2 + ["--zero-stage", "3"]),
        "tp2 (kv whole)": ("gqa", TP2),
        "pp2": ("mha", ["--pipeline-model-parallel-size", "2"])},
    4: {"sp2 x cp2 (ring) full recompute": ("mha", SP2 + ["--context-parallel-size", "2"]
                                              + FULL)},
}
# (hq, hkv, G): MHA; GQA with kv grouped (2 kv heads a rank at P = 2); kv whole (one a
# rank); kv repeated (one kv head, P = 2); G = hq/P (one head a group)
CASES = [(8, 8, 2), (8, 8, 4), (8, 4, 2), (8, 2, 2), (8, 2, 4), (8, 1, 2)]
B, S, D = 2, 32, 8


def _args(tmp, name: str, style: str, flags) -> tuple:
    path = str(tmp / f"{name}.jsonl")
    return path, TINY + STEPS + STYLES[style] + list(flags) + [
        "--metrics-jsonl", path, "--data-cache-path", str(tmp / "cache")]


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


class _Counted:
    """A core that counts its calls."""

    def __init__(self, core):
        self.core, self.calls = core, 0

    def __call__(self, q, k, v, dropout_p=0.0, mask=None):
        self.calls += 1
        return self.core(q, k, v, dropout_p, mask)


def _compare(make, q, k, v, dy, groups: int) -> dict:
    """(largest relative difference of out and grads, core calls forward + backward,
    core calls without grad) of `HeadGroups(make(core), groups)` against `make(core)`."""
    from megaulysses.model.attention import cpu_attention, math_attention, sdpa_attention
    from megaulysses.parallel.head_groups import HeadGroups
    from megaulysses.parallel.recompute import RecomputedCore
    out = {}
    for name, core in (("math", math_attention), ("sdpa", sdpa_attention),
                       ("block", cpu_attention)):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = make(core)(*ins, 0.0)
        ref_grads = torch.autograd.grad(ref, ins, dy)
        counted = _Counted(core)
        grouped = HeadGroups(make(RecomputedCore(counted)), groups)  # unwrapped inside
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        handed = list(ins)
        y = grouped.take(handed, 0.0)
        grads = torch.autograd.grad(y, ins, dy)
        calls = counted.calls
        with torch.no_grad():
            counted.calls = 0
            grouped(*ins, 0.0)
        err = max([_rel(y, ref)] + [_rel(a, b) for a, b in zip(grads, ref_grads, strict=True)])
        out[name] = (err, calls, counted.calls, handed == [])
    return out


def attention_checks(rank, world) -> dict:
    """Grouped Ulysses == ungrouped on this rank's shard, per case and core."""
    from megaulysses.parallel.comm import Comm
    from megaulysses.parallel.dims import ParallelDims, build_mesh
    from megaulysses.parallel.ulysses import UlyssesAttention, slice_sequence
    comm = Comm(build_mesh(ParallelDims(dp=1, tp=1, pp=1, sp=world), "cpu"))
    out = {}
    for hq, hkv, groups in CASES:
        g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + groups)
        q, k, v, dy = (slice_sequence(torch.randn(B, S, h, D, generator=g), comm)
                       for h in (hq, hkv, hkv, hq))
        out[(hq, hkv, groups)] = _compare(lambda core: UlyssesAttention(core, comm),
                                          q, k, v, dy, groups)
    return out


def train_grids(rank, world, runs) -> dict:
    """On world 2 the attention checks first; then one Trainer per run, in turn."""
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    logging.disable(logging.INFO)
    out = {"attention": attention_checks(rank, world) if world == 2 else None}
    for args in runs:
        Trainer(parse_args(args)).train()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """{style: per-step losses of one process, without groups}."""
    tmp = tmp_path_factory.mktemp("ref")
    out = {}
    for style in STYLES:
        from megaulysses.config import parse_args
        from megaulysses.training.trainer import Trainer
        path, args = _args(tmp, style, style, [])
        Trainer(parse_args(args)).train()
        out[style] = train_losses(read_jsonl(path))
    return out


@pytest.fixture(scope="module")
def grids(tmp_path_factory):
    """{(world, grid): (losses without groups, with G = 2)}, and the attention checks."""
    out, attention = {}, None
    for world, named in GRIDS.items():
        tmp = tmp_path_factory.mktemp(f"world{world}")
        runs, paths = [], {}
        for i, (name, (style, flags)) in enumerate(named.items()):
            for tag, extra in (("plain", []), ("groups", G2)):
                path, args = _args(tmp, f"{i}-{tag}", style, list(flags) + extra)
                runs.append(args)
                paths[(name, tag)] = path
        result = run_ranks(train_grids, world, runs)
        attention = attention or [r["attention"] for r in result]
        for name in named:
            out[(world, name)] = tuple(train_losses(read_jsonl(paths[(name, tag)]))
                                       for tag in ("plain", "groups"))
    return out, attention


@pytest.mark.parametrize("world,name", [(w, n) for w, named in GRIDS.items() for n in named])
def test_groups_train_like_one_process(reference, grids, world, name):
    plain, grouped = grids[0][(world, name)]
    want = reference[GRIDS[world][name][0]]
    assert sorted(want) == [1, 2, 3, 4]
    for got in (plain, grouped):
        assert got.keys() == want.keys()
        for it in want:
            assert got[it] == pytest.approx(want[it], rel=LOSS_RTOL), (name, it, got, want)


def test_grouped_ulysses_equals_ungrouped_on_each_rank(grids):
    for rank_results in grids[1]:
        assert len(rank_results) == len(CASES)
        for case, per_core in rank_results.items():
            groups = case[2]
            for core, (err, calls, no_grad_calls, taken) in per_core.items():
                assert err < FP32_TOL, (case, core, err)
                # once forward, once recomputed: no third run of a RecomputedCore inside
                assert calls == 2 * groups and no_grad_calls == groups, (case, core, calls)
                assert taken, (case, core)


@pytest.mark.parametrize("hq,hkv,groups", [(4, 4, 2), (4, 4, 4), (4, 2, 2), (4, 1, 2),
                                           (4, 1, 4)])
def test_local_groups_equal_the_core(hq, hkv, groups):
    """sp 1 (tensor parallel ranks, the ring alone): groups of the local heads."""
    g = torch.Generator().manual_seed(hq + hkv + groups)
    q, k, v, dy = (torch.randn(B, S, h, D, generator=g) for h in (hq, hkv, hkv, hq))
    for core, (err, calls, no_grad_calls, taken) in _compare(
            lambda c: c, q, k, v, dy, groups).items():
        assert err < FP32_TOL, (core, err)
        assert calls == 2 * groups and no_grad_calls == groups and taken, core


def test_dropout_replays_in_the_groups_recomputation():
    """The math core with attention dropout: the checkpointed groups' gradients are bit
    for bit those of the same groups run without checkpoints (the recomputation draws
    the same masks)."""
    from megaulysses.model.attention import math_attention
    from megaulysses.parallel import head_groups
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(B, S, 4, D, generator=g) for _ in range(4))
    results = []
    for plain in (False, True):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)
        saved = head_groups.checkpoint
        if plain:  # the same groups, same RNG draws, nothing recomputed
            head_groups.checkpoint = lambda fn, *args, **_: fn(*args)
        try:
            y = head_groups.HeadGroups(math_attention, 2)(*ins, 0.5)
            results.append([y] + list(torch.autograd.grad(y, ins, dy)))
        finally:
            head_groups.checkpoint = saved
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_dropout_losses_identical_with_full_recompute(tmp_path):
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"] + STEPS + G2
    plain = train_losses(run_inprocess(dropout, tmp_path, "plain"))
    full = train_losses(run_inprocess(dropout + FULL, tmp_path, "full"))
    assert sorted(plain) == [1, 2, 3, 4] and full == plain


def test_kept_bytes_fall_with_groups():
    """One process, the math core (it keeps [s, s] probabilities): grouped, forward keeps
    only q, k, v, and forward + backward peaks lower."""
    from megaulysses.model.attention import math_attention
    from megaulysses.parallel.head_groups import HeadGroups
    from megaulysses.training.live_bytes import LiveBytes
    q, k, v = (torch.randn(1, 256, 4, 16, requires_grad=True) for _ in range(3))
    kept, peaks = [], []
    for core in (math_attention, HeadGroups(math_attention, 4)):
        with LiveBytes() as mem:
            y = core(q, k, v, 0.0)
            kept.append(mem.current - y.numel() * 4)
            y.sum().backward()
        del y
        peaks.append(mem.peak)
    assert kept[1] == 0, kept  # the inputs are the caller's: nothing else is kept
    assert kept[0] > 4 * 256 * 256 * 4 and peaks[1] < peaks[0] / 2, (kept, peaks)
