"""Observability (issue 28, item 4): --log-params-norm, --log-num-zeros-in-grad,
--tensorboard-log-interval, --log-timers-to-tensorboard, --profile and --wandb-*.

One process: the logged parameter norm equals the model's, computed here; the zero count
equals what the data makes it (with untied embeddings the input embedding's rows of the
tokens a batch does not hold get no gradient: (vocab - distinct tokens) x hidden zeros);
tensorboard's event files and wandb's offline run file, read back, hold the scalars at
every --tensorboard-log-interval-th iteration, the timers among them. Two ranks, one
spawn: tp2, dp2 under ZeRO-3 (parameters and gradients sharded) and pp2 with tied
embeddings (the last stage's copy counted once) log the norm of their gathered model and
the one-process values; --profile writes a trace for the asked rank only.
"""

import gzip
import json
import logging
import math
import os
import struct
import sys

import pytest

from dist import run_ranks
from helpers import TINY, read_jsonl

VOCAB, HIDDEN = 512, 64  # NullTokenizer --vocab-size 511 + the end-of-document id
BASE = TINY + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
               "--eval-iters", "0", "--log-params-norm", "--log-num-zeros-in-grad",
               "--log-timers-to-tensorboard"]
UNTIED = ["--untie-embeddings-and-output-weights"]
GRIDS = {  # 2 iterations on 2 ranks; each a --tensorboard-dir of its own
    "tp2": UNTIED + ["--tensor-model-parallel-size", "2"],
    "dp2-zero3": UNTIED + ["--zero-stage", "3", "--profile", "--profile-step-start", "0",
                           "--profile-step-end", "1", "--profile-ranks", "1"],
    "pp2-tied": ["--pipeline-model-parallel-size", "2"],
}
PHASES = {"time_forward_s", "time_backward_s", "time_optimizer_s"}


def outputs(tmp, name: str) -> list:
    return ["--tensorboard-dir", str(tmp / name / "tb"), "--metrics-jsonl",
            str(tmp / f"{name}.jsonl"), "--data-cache-path", str(tmp / "cache")]


def hand_norm(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def scalars(tb_dir) -> dict:
    """{tag: {step: value}} of a tensorboard directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_history(run_file) -> dict:
    """{step: {key: value}} of an offline run's .wandb file: wandb's own records
    (wandb_internal_pb2.Record) in its LevelDB-style log: a 7-byte file header, then
    32 KiB blocks of chunks, each a 7-byte header (crc32, length, type: 1 whole, 2 first,
    3 middle, 4 last) and its bytes. wandb 0.31 ships no Python reader for it."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, block = open(run_file, "rb").read(), 32 * 1024
    assert data[:4] == b":W&B"
    pos, pieces, history = 7, [], {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pieces.append(data[pos + 7:pos + 7 + n])
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(pieces))
            pieces = []
            if rec.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in rec.history.item}
                history[row["_step"]] = row
    return history


def test_one_process_against_hand_counts_tensorboard_and_wandb(tmp_path, monkeypatch, caplog):
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    for var in ("WANDB_MODE", "WANDB_API_KEY", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key: offline
    caplog.set_level(logging.INFO)
    args = BASE + UNTIED + outputs(tmp_path, "one") + [
        "--train-iters", "4", "--tensorboard-log-interval", "2", "--wandb-project", "obs",
        "--wandb-exp-name", "one", "--wandb-save-dir", str(tmp_path / "wandb")]
    trainer = Trainer(parse_args(args))
    trainer.train()
    recs = {r["iteration"]: r for r in read_jsonl(tmp_path / "one.jsonl") if "loss" in r}
    assert sorted(recs) == [1, 2, 3, 4]
    # the norm after the last step, each parameter once
    assert recs[4]["params_norm"] == pytest.approx(hand_norm(trainer.model.parameters()),
                                                   rel=1e-12)
    for it, r in recs.items():  # only the input embedding's untouched rows are zero
        batches = trainer.train_data.micro_batches((it - 1) * 4, 4)
        seen = {int(t) for b in batches for t in b["tokens"].flatten()}
        assert r["num_zeros"] == (VOCAB - len(seen)) * HIDDEN, it
    line = [m for m in caplog.messages if m.startswith("iteration      4/")][0]
    assert f"num zeros {recs[4]['num_zeros']} | params norm {recs[4]['params_norm']:.3f}" in line
    assert "offline (no WANDB_MODE and no API key)" in caplog.text

    # tensorboard: each iteration's values every 2nd iteration, the log window's at each
    tb = scalars(tmp_path / "one" / "tb")
    for key in ("loss", "params_norm", "num_zeros", *PHASES):
        assert sorted(tb[key]) == [2, 4], key
    assert tb["params_norm"][4] == pytest.approx(recs[4]["params_norm"], rel=1e-6)
    assert tb["num_zeros"][2] == recs[2]["num_zeros"]
    assert sorted(tb["mfu"]) == [1, 2, 3, 4]
    assert all(v > 0 for key in PHASES for v in tb[key].values())
    assert not any(tag.startswith("time_comm_") for tag in tb)  # one process: none

    # wandb, offline: the same scalars at the same steps, in its run file
    run_dir = tmp_path / "wandb" / "wandb"
    [run_file] = [os.path.join(d, f) for d, _, fs in os.walk(run_dir) for f in fs
                  if f.endswith(".wandb")]
    assert "offline-run-" in run_file
    history = wandb_history(run_file)
    assert {s for s, row in history.items() if "loss" in row} == {2, 4}
    assert history[4]["params_norm"] == pytest.approx(recs[4]["params_norm"], rel=1e-6)
    assert history[2]["num_zeros"] == recs[2]["num_zeros"]
    assert history[4]["time_forward_s"] > 0 and history[3]["mfu"] > 0


def train_grids(rank, world, runs) -> list:
    """Each run in turn on these ranks; rank 0: the norm of the model gathered whole."""
    from megaulysses.config import parse_args
    from megaulysses.parallel.pipeline import full_state_dict
    from megaulysses.training.trainer import Trainer
    logging.disable(logging.INFO)
    out = []
    for args in runs:
        trainer = Trainer(parse_args(args))
        trainer.train()
        whole = full_state_dict(trainer.model, trainer.comm)  # every rank takes part
        out.append(hand_norm(whole.values()) if whole is not None else None)
    return out


@pytest.fixture(scope="module")
def grid_runs(tmp_path_factory):
    """{grid: (rank 0's hand-computed norm, its records, its tensorboard scalars)}, and
    the one-process records of the untied grids' flags."""
    tmp = tmp_path_factory.mktemp("grids")
    runs = [BASE + flags + outputs(tmp, name) + ["--train-iters", "2"]
            for name, flags in GRIDS.items()]
    norms = run_ranks(train_grids, 2, runs, timeout=300)[0]
    return tmp, {name: (norm, {r["iteration"]: r for r in read_jsonl(tmp / f"{name}.jsonl")},
                        scalars(tmp / name / "tb"))
                 for name, norm in zip(GRIDS, norms, strict=True)}


def test_grids_log_the_norm_of_their_whole_model_and_the_one_process_values(grid_runs,
                                                                            tmp_path):
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    _, runs = grid_runs
    for name, (norm, recs, _) in runs.items():
        assert sorted(recs) == [1, 2], name
        assert recs[2]["params_norm"] == pytest.approx(norm, rel=1e-12), name
    logging.disable(logging.INFO)  # the reference, one process, the untied grids' flags
    try:
        Trainer(parse_args(BASE + UNTIED + outputs(tmp_path, "one") + ["--train-iters", "2"])
                ).train()
    finally:
        logging.disable(logging.NOTSET)
    one = {r["iteration"]: r for r in read_jsonl(tmp_path / "one.jsonl")}
    for name in ("tp2", "dp2-zero3"):
        recs = runs[name][1]
        for it in (1, 2):
            assert recs[it]["num_zeros"] == one[it]["num_zeros"], (name, it)
            assert recs[it]["params_norm"] == pytest.approx(one[it]["params_norm"], rel=1e-6)


def test_grid_timers_in_tensorboard_and_the_profiled_rank_only(grid_runs):
    tmp, runs = grid_runs
    kinds = {"tp2": {"all_reduce"}, "dp2-zero3": {"all_gather", "reduce_scatter"},
             "pp2-tied": {"p2p"}}
    for name, (_, _, tb) in runs.items():
        for tag in PHASES | {f"time_comm_{k}_s" for k in kinds[name]}:
            assert sorted(tb.get(tag, {})) == [1, 2], (name, tag, sorted(tb))
            assert all(v > 0 for v in tb[tag].values()), (name, tag)
    traces = tmp / "dp2-zero3" / "torch_profile"
    assert sorted(os.listdir(traces)) == ["rank-1.pt.trace.json.gz"]
    with gzip.open(traces / "rank-1.pt.trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("ph") == "X" and e.get("name", "").startswith("aten::") for e in events)
    for name in ("tp2", "pp2-tied"):  # no --profile there
        assert not (tmp / name / "torch_profile").exists()


@pytest.mark.parametrize("case", ["wandb not installed", "trace directory is a file"])
def test_bad_observability_setups_stop_with_one_line(case, tmp_path, monkeypatch, capfd):
    """The rows of tests/test_invalid_flags.py that need a changed environment."""
    import pretrain_gpt
    if case == "wandb not installed":
        monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails
        flags = ["--wandb-project", "p", "--wandb-exp-name", "e", "--save", str(tmp_path / "c")]
        want = "error: --wandb-project: needs the wandb package"
    else:
        (tmp_path / "torch_profile").write_text("not a directory")
        flags = ["--profile", "--tensorboard-dir", str(tmp_path / "tb")]
        want = f"error: --profile: cannot write to {tmp_path / 'torch_profile'}"
    rc = pretrain_gpt.main(BASE + flags + ["--data-cache-path", str(tmp_path / "cache")])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(want), err
