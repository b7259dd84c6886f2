"""A run never overwrites an earlier run's outputs without saying so: a fresh start into
a metrics file or checkpoint directory that already holds a run is refused with one line;
the same command with --load resumes and continues them (the bundled default run is such
a command: python pretrain_gpt.py twice resumes, its metrics stay)."""

import pytest
from helpers import TINY, read_jsonl

ARGS = ["--train-iters", "4", "--eval-iters", "0"]


def run_main(args, tmp_path, capfd) -> tuple[int, list[str]]:
    import pretrain_gpt
    capfd.readouterr()
    rc = pretrain_gpt.main(TINY + ARGS + ["--data-cache-path", str(tmp_path / "cache")] + args)
    return rc, capfd.readouterr().err.strip().splitlines()


@pytest.fixture
def finished(tmp_path, capfd):
    """A finished run: 4 iterations, its metrics and its checkpoint."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    assert run_main(["--save", str(ck), "--metrics-jsonl", str(metrics)], tmp_path, capfd)[0] == 0
    return ck, metrics, metrics.read_text()


def test_a_fresh_run_into_earlier_metrics_is_refused(finished, tmp_path, capfd):
    ck, metrics, before = finished
    rc, err = run_main(["--metrics-jsonl", str(metrics)], tmp_path, capfd)
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"error: --metrics-jsonl: {metrics} already holds an earlier "
                             "run's records"), err
    assert metrics.read_text() == before


def test_a_fresh_run_into_earlier_checkpoints_is_refused(finished, tmp_path, capfd):
    ck, metrics, _ = finished
    rc, err = run_main(["--save", str(ck), "--metrics-jsonl", str(tmp_path / "new.jsonl")],
                       tmp_path, capfd)
    assert rc == 2 and len(err) == 1
    assert err[0] == (f"error: --save: {ck} already holds another run's checkpoints "
                      f"(iter_0000004) that this run would overwrite: pass --load {ck} to "
                      "resume it, or delete them"), err
    assert not (tmp_path / "new.jsonl").exists()


def test_the_same_command_with_load_resumes_and_keeps_the_metrics(finished, tmp_path, capfd):
    ck, metrics, before = finished
    rc, _ = run_main(["--save", str(ck), "--load", str(ck), "--metrics-jsonl", str(metrics)],
                     tmp_path, capfd)
    assert rc == 0 and metrics.read_text() == before  # finished: nothing to train or add
    rc, _ = run_main(["--save", str(ck), "--load", str(ck), "--metrics-jsonl", str(metrics),
                      "--train-iters", "6"], tmp_path, capfd)
    assert rc == 0
    assert [r["iteration"] for r in read_jsonl(metrics) if "loss" in r] == list(range(1, 7))


def test_the_default_run_resumes_its_own_outputs():
    import pretrain_gpt
    from megaulysses.config import parse_args
    cfg = parse_args(pretrain_gpt.DEFAULT_RUN)
    assert cfg.train.load == cfg.train.save == "runs/default/checkpoints"
    assert cfg.log.metrics_jsonl == "runs/default/metrics.jsonl"
    assert cfg.train.generate == 200  # the run without flags samples; any flag: not
    assert parse_args(["--train-iters", "5"]).train.generate == 0
    # min-lr 2e-4 is the bundled preset's, with or without flags (not a data source)
    assert cfg.train.min_lr == parse_args([]).train.min_lr == 2e-4
