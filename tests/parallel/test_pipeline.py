"""Pipeline parallelism: stage layouts, and every pipeline grid trains like one process.

The parity runs follow test_parity.py (same tolerances, 10 fp32 steps of 8 samples) on a
4-layer model, so pp4 and two virtual stages per rank have a layer per stage. Each run
also checks that the tied word embedding is bitwise the same on the first and the last
stage, and that the pipeline sends are counted: the busiest rank's p2p bytes per
iteration are the activations (or their gradients) of every micro-batch, plus the tied
embedding's gradient.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from dist import free_port, run_ranks
from helpers import REPO, read_jsonl, with_vocab
from test_parity import GPT2, TINY, assert_same_run, one_process_runs, run_args

from megaulysses.config import ConfigError, parse_args, pipeline_layout, resolve

DEEP = ["--num-layers", "4"]
STYLES = {"llama": DEEP, "untied": DEEP + ["--untie-embeddings-and-output-weights"],
          "gpt2": DEEP + GPT2}
PP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
TP2, SP2 = ["--tensor-model-parallel-size", "2"], ["--ds-sequence-parallel-size", "2"]
# Grad norms: at step 1 (same parameters) they differ only by the order fp32 squares are
# summed over ~0.4M elements (~3e-5 seen); later steps start from parameters that differ
# in their last bits, and the norm of this small, fast-moving model amplifies that more
# than the loss does (up to ~7e-4 seen at step 9 with tp2, the loss still within 1e-5).
GRAD_NORM_RTOL_FIRST, GRAD_NORM_RTOL = 1e-4, 3e-3


def train(rank, world, args):
    """Returns (whole parameters on rank 0, this rank's tied-embedding info)."""
    from megaulysses.parallel.pipeline import full_state_dict
    from megaulysses.training.trainer import Trainer
    trainer = Trainer(parse_args(args))
    trainer.train()
    state = full_state_dict(trainer.model, trainer.comm)
    comm, model = trainer.comm, trainer.model
    tied = None
    if model.embed is not None and not model.cfg.untie_embeddings_and_output_weights:
        w = model.embed.word.weight
        w = w.to_local() if hasattr(w, "to_local") else w
        tied = ((comm.rank("dp"), comm.rank("sp"), comm.rank("tp")), comm.rank("pp"),
                w.detach().numpy().copy())
    params = None if state is None else {k: v.numpy().copy() for k, v in state.items()}
    return params, tied


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process_runs(tmp_path_factory.mktemp("ref"), STYLES,
                            lambda args: train(0, 1, args)[0])


def assert_tied_identical(results, pp: int):
    """The first and the last stage of each (dp, sp, tp) hold equal word embeddings."""
    copies = {}
    for _, tied in results:
        if tied is not None:
            where, pp_rank, w = tied
            copies.setdefault(where, {})[pp_rank] = w
    assert copies
    for where, by_stage in copies.items():
        assert sorted(by_stage) == [0, pp - 1], (where, sorted(by_stage))
        np.testing.assert_array_equal(by_stage[0], by_stage[pp - 1])


def assert_grad_norms(records, ref_records):
    got = {r["iteration"]: r["grad_norm"] for r in records if "grad_norm" in r}
    want = {r["iteration"]: r["grad_norm"] for r in ref_records if "grad_norm" in r}
    assert got.keys() == want.keys()
    for it in want:
        rtol = GRAD_NORM_RTOL_FIRST if it == 1 else GRAD_NORM_RTOL
        assert got[it] == pytest.approx(want[it], rel=rtol), it


def pp2_p2p_bytes(flags, dp: int, b=2, s=32, h=64, vocab=4096) -> int:
    """Bytes either rank of a pp2 grid sends per iteration: the activations [b, s/sp, h]
    fp32 of each of its micro-batches (rank 0 forward, rank 1 their gradients back); three
    times that with two virtual stages per rank (stages 0, 2 | 1, 3: each rank also sends
    both ways between its two stages' neighbours); plus the tied embedding's gradient
    shard [V/tp, h] once."""
    sp = 2 if "--ds-sequence-parallel-size" in flags else 1
    tp = 2 if "--tensor-model-parallel-size" in flags else 1
    micro = 8 // (2 * dp)  # --global-batch-size 8, --micro-batch-size 2
    sends = 3 if "--num-layers-per-virtual-pipeline-stage" in flags else 1
    return sends * micro * b * (s // sp) * h * 4 + vocab // tp * h * 4


FULL = ["--recompute-granularity", "full"]
# Recomputation is exact: some grids run with it, against the one process without it.
GRIDS = [  # (style, world, flags)
    ("llama", 2, PP2 + FULL + ["--recompute-num-layers", "2"]),  # each stage one group
    ("llama", 4, PP2),  # dp2: each rank 2 micro-batches; gradients reduced after
    ("llama", 4, PP2 + TP2),
    ("gpt2", 4, PP2 + SP2 + ["--recompute-activations"]),  # learned positions (first stage
    # only), biases, LayerNorm; the attention core recomputed between the all-to-alls
    ("llama", 2, PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]),  # interleaved
    ("llama", 2, PP2 + ["--pipeline-schedule", "zero-bubble"] + FULL + [
        "--recompute-method", "block"]),  # backward in two passes (inputs, then weights)
    ("llama", 2, PP2 + ["--pipeline-schedule", "gpipe", "--decoder-first-pipeline-num-layers",
                        "1"]),  # uneven: 1 + 3
    ("untied", 4, PP2 + TP2 + ["--sequence-parallel"]),  # output layer on the last stage
    ("llama", 4, PP4),  # middle stages: each receives and sends both ways
]
IDS = ["pp2-full", "pp2-dp2", "pp2-tp2", "gpt2-pp2-sp2-selective", "pp2-interleaved",
       "pp2-zero-bubble-full-block",
       "pp2-gpipe-uneven", "untied-pp2-tp2-megatron-sp", "pp4"]


@pytest.mark.parametrize("style,world,flags", GRIDS, ids=IDS)
def test_pipeline_grid_equals_one_process(reference, tmp_path, style, world, flags):
    path, args = run_args(tmp_path, "grid", STYLES[style], flags)
    results = run_ranks(train, world, args)
    ref_records, ref_params = reference[style]
    records = read_jsonl(path)
    assert_same_run(records, ref_records, results[0][0], ref_params)
    assert_grad_norms(records, ref_records)
    if style != "untied":
        assert_tied_identical(results, 4 if flags == PP4 else 2)
    if "--sequence-parallel" not in flags and flags[:2] == PP2:
        dp = world // 2 // (2 if "--tensor-model-parallel-size" in flags else 1) // (
            2 if "--ds-sequence-parallel-size" in flags else 1)
        step = [r for r in records if "loss" in r][-1]
        assert step["comm_bytes_p2p"] == pp2_p2p_bytes(flags, dp)


@pytest.mark.parametrize("world,flags", [(8, PP2 + TP2 + SP2)], ids=["pp2-tp2-sp2"])
def test_torchrun_cli_equals_one_process(reference, tmp_path, world, flags):
    """The real command line: torchrun -> pretrain_gpt.py, sampling at the end (the
    stages and shards are gathered to rank 0 for it). (pp4 runs in GRIDS: one torchrun
    of 8 processes proves the command line.)"""
    path, args = run_args(tmp_path, "cli", STYLES["llama"], flags + ["--generate", "8"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(world), "--master-port", str(free_port()),
                           os.path.join(REPO, "pretrain_gpt.py"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_jsonl(path)
    assert_same_run(records, reference["llama"][0])
    assert_grad_norms(records, reference["llama"][0])
    assert "x pp 2 x" in proc.stdout and "1f1b schedule, 4 micro-batches" in proc.stdout
    assert "---- sample from the trained model ----" in proc.stdout


def layout(num_layers, *flags):
    cfg = parse_args(["--num-layers", str(num_layers), *flags])
    return pipeline_layout(cfg.model.num_layers, cfg.parallel)


def test_stage_layouts():
    assert layout(6, *PP2) == [[0, 1, 2], [3, 4, 5]]
    assert layout(8, *PP2, "--num-layers-per-virtual-pipeline-stage", "2") == [
        [0, 1], [2, 3], [4, 5], [6, 7]]  # rank 0 runs stages 0 and 2
    assert layout(6, *PP4, "--decoder-first-pipeline-num-layers", "0",
                  "--decoder-last-pipeline-num-layers", "2") == [[], [0, 1], [2, 3], [4, 5]]
    assert layout(5, *PP2, "--decoder-last-pipeline-num-layers", "1") == [[0, 1, 2, 3], [4]]
    cfg = resolve(parse_args(PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]), 2, 4096)
    assert cfg.parallel.pipeline_schedule == "interleaved-1f1b"


BAD_LAYOUTS = [  # flags, words the message must hold
    (["--num-layers", "5"] + PP2, ["--pipeline-model-parallel-size", "--num-layers 5"]),
    (["--num-layers", "6", "--num-layers-per-virtual-pipeline-stage", "2"] + PP2,
     ["--num-layers-per-virtual-pipeline-stage", "pp * 2"]),
    (["--num-layers", "6", "--decoder-first-pipeline-num-layers", "1"] + PP4,
     ["--decoder-first-pipeline-num-layers", "5 layers left", "3 stages"]),
    (["--num-layers", "6", "--decoder-first-pipeline-num-layers", "2",
      "--decoder-last-pipeline-num-layers", "2"] + PP2, ["all 6 layers"]),
    (PP2 + ["--pipeline-schedule", "interleaved-1f1b"],
     ["--pipeline-schedule", "--num-layers-per-virtual-pipeline-stage"]),
    (PP2 + ["--pipeline-schedule", "1f1b", "--num-layers-per-virtual-pipeline-stage", "1"],
     ["--num-layers-per-virtual-pipeline-stage", "one stage per rank"]),
    (["--num-layers-per-virtual-pipeline-stage", "1"], ["--pipeline-model-parallel-size > 1"]),
    (["--decoder-last-pipeline-num-layers", "7"] + PP2, ["must be in [0, --num-layers 6]"]),
]


@pytest.mark.parametrize("flags,words", BAD_LAYOUTS)
def test_bad_layout_names_the_flag(flags, words):
    with pytest.raises(ConfigError) as e:
        parse_args(flags)
    for w in words:
        assert w in str(e.value), str(e.value)


def main_rc(rank, world, args):
    import pretrain_gpt
    return pretrain_gpt.main(args)


BAD_GRIDS = [  # world, flags: every rank exits 2, none hangs (the other rules: in-process)
    (4, DEEP + ["--pipeline-model-parallel-size", "3"]),  # does not divide the world
    (2, DEEP + PP2 + ["--global-batch-size", "2"]),  # 1 micro-batch, 1f1b needs >= pp
]


@pytest.mark.parametrize("world,flags", BAD_GRIDS, ids=["world", "1f1b-micro"])
def test_bad_pipeline_grid_exits_2_on_every_rank(world, flags):
    assert run_ranks(main_rc, world, TINY + flags, timeout=120) == [2] * world


def test_too_few_micro_batches_message():
    from megaulysses.config import ParallelDims, check_grid
    cfg = parse_args(DEEP + PP2 + ["--micro-batch-size", "2", "--global-batch-size", "2",
                                   "--vocab-size", "128",
                                   "--tokenizer-type", "NullTokenizer"])
    cfg = with_vocab(cfg, 128)
    with pytest.raises(ConfigError, match="1 micro-batches per pipeline.*1f1b needs at least"):
        check_grid(ParallelDims.from_world(2, pp=2), cfg.model, 2, 2)
    with pytest.raises(ConfigError, match="zero-bubble needs a multiple of pp = 2"):
        check_grid(ParallelDims.from_world(2, pp=2), cfg.model, 6, 2,
                   pipeline_schedule="zero-bubble")
