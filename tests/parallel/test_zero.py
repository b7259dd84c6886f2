"""ZeRO 1, 2 and 3 over dp x sp: every grid trains like one process and holds 1/N of the
model states (N = dp * sp).

Parity follows test_parity.py with its tolerances: the tiny Llama-style GQA model, fp32
steps of 8 samples, per-step losses and eval losses within 1e-5 relative, final parameters
within 5e-5 absolute; 3 steps here, not test_parity's 10 (`STEPS`). Each grid runs stages
0, 1, 2 and 3 one after the other in the same ranks (one spawn per grid, four Trainers).

On tp2 x sp2 x dp2 stages 1-3 run with activation recomputation (`RECOMPUTE`), which
changes nothing a step computes.

Checkpoints: stage 3 saves in the background after every iteration; dp2 resumes from
iteration 1 bit for bit, and iteration 1 saved at tp2 x sp2 x dp2 loads at 1 process, at
sp4 with ZeRO-1, at tp2 and at pp2 and goes on like the one-process run (the issue's
reload-on-another-grid check).

Memory is asserted from the tensors each rank holds (`Zero.held_bytes`), right after the
optimizer step, against P = the bytes of this rank's whole parameters (its tensor-parallel
shard of the model: what stage 0 holds once as parameters, once as gradients and twice as
AdamW's moments). Stage 3 must hold at most 1.1 x 4P/N plus the documented remainder:
AdamW's step counters, one 4-byte scalar per parameter tensor on every rank.

Bytes moved per step (grids without tp, where nothing else all-gathers or reduce-scatters),
m = micro-batches per rank, G = P (fp32 gradients), each sent (N-1)/N times:
    stage 1  reduce-scatter G, all-gather P              (stage 0's all-reduce, split)
    stage 2  reduce-scatter m G, all-gather P            (parameters gathered once a step)
    stage 3  reduce-scatter m G, all-gather m (root + 2 blocks): each block gathered for its
             forward and again for its backward, the root unit (embedding, final norm) once
"""

from functools import partial

import pytest

from dist import run_ranks
from helpers import TINY, parsed, read_jsonl, train_losses
import test_parity
from test_pipeline import assert_grad_norms, assert_tied_identical

# 3 steps (test_parity runs 10; a grid's cost here is mostly per Trainer and per step):
# every step compares a loss and a gradient norm, and from the second on the update
# before it, with AdamW's moments. Stage 3 saves every SAVED iterations, 1: a run resumed
# at iteration 1 takes 2 steps, and the second one's loss shows the restored moments (the
# first one's only the restored weights). One evaluation, after the last step; no test
# split (Megatron-LM's 969,30,1 made one, evaluated at the end of every run and compared
# nowhere; the training split is the same).
ITERS, SAVED = 3, 1
STEPS = ["--train-iters", str(ITERS), "--global-batch-size", "8", "--eval-interval", str(ITERS),
         "--split", "969,31,0"]

STAGES = (1, 2, 3)
# tp2 x sp2 x dp2 runs its ZeRO stages with recomputation (exact: still equal to the one
# process without it): selective inside the all-to-alls, full by blocks, full uniform
# with the MLP tiled in 2 chunks.
FULL = ["--recompute-granularity", "full"]
RECOMPUTE = {1: ["--recompute-activations"], 2: FULL + ["--recompute-method", "block"],
             3: FULL + ["--tiled-mlp-chunks", "2"]}
TP2, SP2 = ["--tensor-model-parallel-size", "2"], ["--ds-sequence-parallel-size", "2"]
HEADROOM = 1.1  # the issue's bound on model-state bytes per rank (padding, step counters)


def train_runs(rank, world, configs):
    """Trains one Trainer per Config (helpers.parsed), one after the other in these
    ranks. Per run: (whole parameters on rank 0, this rank's held bytes after the last
    step, the bytes of its parameters' local tensors (stage 0 and 1: the whole
    tensor-parallel shard P), its tied-embedding copy under pp)."""
    from megaulysses.parallel.grad_reduce import _local
    from megaulysses.parallel.pipeline import full_state_dict
    from megaulysses.training.trainer import Trainer
    out = []
    for cfg in configs:
        trainer = Trainer(cfg)
        trainer.train()
        state = full_state_dict(trainer.model, trainer.comm)  # every rank takes part
        params = None if state is None else {k: v.numpy().copy() for k, v in state.items()}
        whole = sum(_local(p).numel() * 4 for p in trainer.model.parameters())
        tied = _tied_copy(trainer)
        out.append((params, dict(trainer.zero.at_step), whole, tied))
    return out


def _tied_copy(trainer):
    """(where, pp rank, this rank's rows of the tied word embedding) or None."""
    from megaulysses.parallel.grad_reduce import _local
    model, comm = trainer.model, trainer.comm
    if comm.size("pp") == 1 or model.embed is None or \
            model.cfg.untie_embeddings_and_output_weights:
        return None
    where = (comm.rank("dp"), comm.rank("sp"), comm.rank("tp"))
    return where, comm.rank("pp"), _local(model.embed.word.weight).detach().numpy().copy()


# test_parity's helpers at this module's STEPS
run_args = partial(test_parity.run_args, steps=STEPS)
one_process_runs = partial(test_parity.one_process_runs, steps=STEPS)


def assert_same_run(records, ref_records, params=None, ref_params=None):
    """test_parity's (its tolerances) over this module's ITERS steps, an evaluation
    required."""
    assert any("eval_loss" in r for r in records)
    test_parity.assert_same_run(records, ref_records, params, ref_params, iters=ITERS)


def grid_args(tmp_path, flags) -> list:
    """test_parity's run, without its --metrics-jsonl (each stage writes its own)."""
    return TINY + STEPS + list(flags) + ["--data-cache-path", str(tmp_path / "cache")]


def run_stages(tmp_path, world, flags, stages=STAGES, extra=None):
    """`extra`: more flags for some stages, {stage: flags}."""
    paths = [str(tmp_path / f"zero{z}.jsonl") for z in stages]
    runs = [grid_args(tmp_path, flags) + ["--zero-stage", str(z)] + (extra or {}).get(z, [])
            + ["--metrics-jsonl", p] for z, p in zip(stages, paths, strict=True)]
    return paths, run_ranks(train_runs, world, parsed(runs))


@pytest.fixture(scope="module")
def grid_runs(tmp_path_factory):
    """`grid_runs(world, flags)` -> (stage-3 checkpoint dir, paths, results): stages 0-3
    of a grid in one spawn, run once per module. Stage 3 also saves in the background
    every SAVED iterations: the checkpoint tests at the end load its iteration SAVED."""
    cache = {}

    def get(world, flags):
        key = (world, tuple(flags))
        if key not in cache:
            tmp = tmp_path_factory.mktemp("grid")
            ck = str(tmp / "ck")
            save = ["--save", ck, "--save-interval", str(SAVED), "--async-save"]
            extra = {1: [], 2: [], 3: save}
            if world == 8:  # the whole grid: each ZeRO stage with a kind of recomputation
                for stage, more in RECOMPUTE.items():
                    extra[stage] = extra[stage] + more
            cache[key] = (ck, *run_stages(tmp, world, flags, (0,) + STAGES, extra))
        return cache[key]
    return get


def train_one(args) -> dict:
    """One process: train with `args`, return the final parameters (one_process_runs's
    `params_of`)."""
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    trainer = Trainer(parse_args(args))
    trainer.train()
    return {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process_runs(tmp_path_factory.mktemp("ref"), {"llama-gqa": []}, train_one)[
        "llama-gqa"]


def assert_memory(stage: int, held: dict, whole: int, n: int, n_tensors: int):
    """Model states held right after the optimizer step, against the whole-model bytes P."""
    counters = 4 * n_tensors  # AdamW's step counters: one fp32 scalar per parameter tensor
    rows = HEADROOM * whole / n
    if stage == 1:
        assert held["params"] == whole  # parameters replicated, the rows are views into them
    else:
        assert held["params"] <= rows, held
    assert held["grads"] <= rows, held  # the reduced rows only (ZeRO-1 frees full grads)
    assert held["optim"] <= 2 * rows + counters, held
    if stage == 3:  # the issue's bound, on everything together
        assert sum(held.values()) <= HEADROOM * 4 * whole / n + counters, held


def assert_step_bytes(stage: int, record: dict, whole: int, root: int, n: int, micro: int):
    share = (n - 1) / n
    want_ag = {1: whole, 2: whole, 3: micro * (root + 2 * (whole - root))}[stage] * share
    want_rs = (1 if stage == 1 else micro) * whole * share
    assert record["comm_bytes_all_gather"] == pytest.approx(want_ag, rel=1e-6), stage
    assert record["comm_bytes_reduce_scatter"] == pytest.approx(want_rs, rel=1e-6), stage


GRIDS = [(2, []), (4, SP2), (4, ["--ds-sequence-parallel-size", "4"]), (8, TP2 + SP2)]


@pytest.mark.parametrize("world,flags", GRIDS, ids=["dp2", "dp2-sp2", "sp4", "dp2-sp2-tp2"])
def test_zero_stages_equal_one_process(reference, grid_runs, world, flags):
    """Stages 0 (the plain grid: test_parity's case, run here in the same ranks) to 3;
    stage 3 saving in the background on the way changes nothing."""
    ref_records, ref_params = reference
    stages = (0,) + STAGES
    one = stages.index(1)  # stage 1 holds the whole (tp-local) parameters
    _, paths, results = grid_runs(world, flags)
    tp = 2 if "--tensor-model-parallel-size" in flags else 1
    sp = int(flags[flags.index("--ds-sequence-parallel-size") + 1]) if flags else 1
    n = world // tp  # dp x sp
    micro = 8 // (2 * (n // sp))  # global batch 8 in micro-batches of 2 per dp rank
    root = 4 * sum(v.size for k, v in ref_params.items() if not k.startswith("layers."))
    for i, (stage, path) in enumerate(zip(stages, paths, strict=True)):
        records = read_jsonl(path)
        params = results[0][i][0]
        assert_same_run(records, ref_records, params, ref_params)
        assert_grad_norms(records, ref_records)
        if stage == 0:
            continue
        for rank_results in results:
            assert_memory(stage, rank_results[i][1], rank_results[one][2], n, len(ref_params))
        if tp == 1:
            assert_step_bytes(stage, [r for r in records if "loss" in r][-1],
                              results[0][one][2], root, n, micro)
    # What stages 2 and 3 differ in is held during a step: stage 2 keeps every parameter
    # gathered through the step, stage 3 the root unit and at most a block at a time.
    peak = {z: max(r["mem_params_bytes"] for r in read_jsonl(p) if "loss" in r)
            for z, p in zip(stages, paths, strict=True)}
    whole = results[0][one][2]
    block = max(_block_bytes(ref_params).values()) // tp
    assert peak[2] >= whole + whole / n, peak
    assert peak[3] <= HEADROOM * whole / n + root // tp + block < peak[2], peak


def _block_bytes(params: dict) -> dict:
    out = {}
    for name, value in params.items():
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            out[i] = out.get(i, 0) + 4 * value.size
    return out


DEEP = ["--num-layers", "4"]


def test_zero_under_pipeline_equals_one_process(tmp_path):
    """pp2 x dp2 with tied embeddings: stage 1 (the issue's case) and stage 3 (FSDP roots
    are the pipeline stages, no resharding inside a step)."""
    ref_records, ref_params = one_process_runs(tmp_path / "ref", {"deep": DEEP},
                                               train_one)["deep"]
    paths, results = run_stages(tmp_path, 4, DEEP + ["--pipeline-model-parallel-size", "2"],
                                stages=(1, 3))
    for i, path in enumerate(paths):
        records = read_jsonl(path)
        assert_same_run(records, ref_records, results[0][i][0], ref_params)
        assert_grad_norms(records, ref_records)
        assert_tied_identical([(None, r[i][3]) for r in results], pp=2)


BF16_RTOL = 5e-3  # bf16 runs: sums in another order, rounded to 8 mantissa bits


def test_bf16_with_fp32_and_bf16_gradient_reduction(tmp_path):
    """--bf16 under zero 1 and 3 trains like one bf16 process; --grad-reduce-dtype bf16
    halves the reduce-scatter bytes, and zero 3 gathers bf16 parameters (half of fp32)."""
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    path, args = run_args(tmp_path, "one", ["--bf16"])
    Trainer(parse_args(args)).train()
    ref = train_losses(read_jsonl(path))
    base = grid_args(tmp_path, ["--bf16"])
    bf16 = ["--grad-reduce-dtype", "bf16"]
    runs = {"z3-fp32": ["--zero-stage", "3"], "z3-bf16": ["--zero-stage", "3"] + bf16,
            "z1-bf16": ["--zero-stage", "1"] + bf16}
    paths = {name: str(tmp_path / f"{name}.jsonl") for name in runs}
    run_ranks(train_runs, 2, parsed(base + runs[name] + ["--metrics-jsonl", paths[name]]
                                    for name in runs))
    records = {}
    for name, p in paths.items():
        records[name] = [r for r in read_jsonl(p) if "loss" in r]
        got = train_losses(records[name])
        for it in ref:
            assert got[it] == pytest.approx(ref[it], rel=BF16_RTOL), (name, it)
    last = {k: v[-1] for k, v in records.items()}
    assert last["z3-bf16"]["comm_bytes_reduce_scatter"] == pytest.approx(
        last["z3-fp32"]["comm_bytes_reduce_scatter"] / 2)
    # fp32 parameters gathered in bf16: half the bytes of test_zero_stages' fp32 formula
    whole = last["z1-bf16"]["mem_params_bytes"]
    assert last["z3-fp32"]["comm_bytes_all_gather"] < whole  # m (root + 2 blocks) / 2 / 2


def train_each(rank, world, configs):
    """One Trainer per Config (helpers.parsed), one after the other in these ranks."""
    from megaulysses.training.trainer import Trainer
    for cfg in configs:
        Trainer(cfg).train()


def test_zero3_checkpoint_resumes_exactly(grid_runs, tmp_path):
    """dp2 at zero 3, resumed from its iteration-SAVED checkpoint (saved in the
    background): the iterations after it equal the run that went on, bit for bit (sharded
    parameters and optimizer states come back exactly where they were)."""
    ck, paths, _ = grid_runs(2, [])
    path, args = run_args(tmp_path, "resumed", [], ["--zero-stage", "3", "--load",
                                                   f"{ck}/iter_{SAVED:07d}"])
    run_ranks(train_each, 2, parsed([args]))
    want, got = train_losses(read_jsonl(paths[3])), train_losses(read_jsonl(path))
    assert sorted(got) == list(range(SAVED + 1, ITERS + 1))
    assert all(got[it] == want[it] for it in got), (got, want)


def assert_continues(path, ref_records):
    """The iterations (and evaluations) of a run loaded at SAVED equal the one-process
    run's within 1e-5 relative: every grid computes the same losses as one process."""
    got, want = train_losses(read_jsonl(path)), train_losses(ref_records)
    assert sorted(got) == list(range(SAVED + 1, ITERS + 1))  # iteration numbers continue
    for it in got:
        assert got[it] == pytest.approx(want[it], rel=1e-5), (path, it)
    evals = {r["iteration"]: r["eval_loss"] for r in read_jsonl(path) if "eval_loss" in r}
    ref_evals = {r["iteration"]: r["eval_loss"] for r in ref_records if "eval_loss" in r}
    assert evals and evals == pytest.approx({k: v for k, v in ref_evals.items() if k > SAVED},
                                            rel=1e-5)


@pytest.fixture(scope="module")
def saved_8(grid_runs):
    """The checkpoint tp2 x sp2 x dp2 at ZeRO-3 saved (in the background) at iteration
    SAVED."""
    return grid_runs(8, TP2 + SP2)[0] + f"/iter_{SAVED:07d}"


def test_grid_checkpoint_loads_on_one_process(reference, saved_8, tmp_path):
    path, args = run_args(tmp_path, "one", [], ["--load", saved_8])
    train_each(0, 1, parsed([args]))  # in this process
    assert_continues(path, reference[0])


def test_grid_checkpoint_loads_at_sp4_with_zero1(reference, saved_8, tmp_path):
    path, args = run_args(tmp_path, "sp4", [], ["--ds-sequence-parallel-size", "4",
                                                "--zero-stage", "1", "--load", saved_8])
    run_ranks(train_each, 4, parsed([args]))
    assert_continues(path, reference[0])


def test_grid_checkpoint_loads_at_tp2_and_at_pp2(reference, saved_8, tmp_path):
    tp_path, tp_args = run_args(tmp_path, "tp2", [], TP2 + ["--load", saved_8])
    pp_path, pp_args = run_args(tmp_path, "pp2", [], ["--pipeline-model-parallel-size", "2",
                                                       "--load", saved_8])
    run_ranks(train_each, 2, parsed([tp_args, pp_args]))
    assert_continues(tp_path, reference[0])
    assert_continues(pp_path, reference[0])


def test_grid_checkpoint_loads_under_ring_attention(reference, saved_8, tmp_path):
    """Saved without a ring (cp 1), loaded at cp2: the ring changes no parameter. (The
    other way, cp2 -> one process, is in test_attention_masks.py.)"""
    path, args = run_args(tmp_path, "cp2", [], ["--context-parallel-size", "2",
                                               "--load", saved_8])
    run_ranks(train_each, 2, parsed([args]))
    assert_continues(path, reference[0])
