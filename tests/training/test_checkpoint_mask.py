"""The attention mask a checkpoint was trained with comes back with it: --load without it
(a mask flag left at its default) is exit 2 naming the flag, a mask given explicitly is
logged, --use-checkpoint-args brings it back. Real tiny checkpoints (tests/helpers TINY,
seq 32); the rules themselves on recorded metadata below."""

import json
import logging
import os

import pytest

import pretrain_gpt
from helpers import TINY, run_main

ONE = ["--train-iters", "1", "--eval-iters", "0", "--save-interval", "1", "--lr-warmup-iters", "0"]


def train(tmp_path, name: str, *flags) -> tuple:
    """pretrain_gpt.main in this process: (exit code, stderr)."""
    rc, _, err = run_main(pretrain_gpt, *TINY, *ONE, "--data-cache-path", tmp_path / "cache",
                          *flags)
    return rc, err


def saved_args(directory, iteration: int) -> dict:
    with open(os.path.join(directory, f"iter_{iteration:07d}", "trainer_state.json")) as f:
        return json.load(f)["args"]["model"]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A run trained with --window-size 8 (1 step)."""
    tmp = tmp_path_factory.mktemp("windowed")
    rc, err = train(tmp, "w", "--window-size", "8", "--save", tmp / "ck")
    assert rc == 0, err
    return tmp


def test_window_forgotten_at_load_is_refused(windowed, tmp_path):
    rc, err = train(tmp_path, "r", "--load", windowed / "ck", "--train-iters", "2")
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: --window-size: "), err
    assert "trained with --window-size 8 but this run has --window-size none" in err, err
    assert "pass --window-size 8" in err and "--window-size 32 (full causal" in err, err


def test_window_given_or_brought_back_loads(windowed, tmp_path, caplog):
    for name, flags in (("same", ["--window-size", "8"]), ("ckargs", ["--use-checkpoint-args"])):
        rc, err = train(tmp_path, name, "--load", windowed / "ck", "--train-iters", "2",
                        "--save", tmp_path / name, *flags)
        assert rc == 0, err
        assert saved_args(tmp_path / name, 2)["window_size"] == 8  # recorded again
    # Given otherwise on purpose: logged, trained, recorded.
    with caplog.at_level(logging.WARNING, "megaulysses.training.load_rules"):
        rc, err = train(tmp_path, "other", "--load", windowed / "ck", "--train-iters", "2",
                        "--window-size", "16", "--save", tmp_path / "other")
    assert rc == 0, err
    assert "trained with --window-size 8; this run attends with --window-size 16" in caplog.text
    assert saved_args(tmp_path / "other", 2)["window_size"] == 16


def test_a_window_added_to_a_full_causal_model_is_logged(tmp_path, caplog):
    rc, err = train(tmp_path, "full", "--save", tmp_path / "ck")
    assert rc == 0, err
    with caplog.at_level(logging.WARNING, "megaulysses.training.load_rules"):
        rc, err = train(tmp_path, "w", "--load", tmp_path / "ck", "--train-iters", "2",
                        "--window-size", "8")
    assert rc == 0, err
    assert "--window-size none; this run attends with --window-size 8" in caplog.text


# -- the rules, on what checkpoints record --------------------------------------------------

def mask(**kw) -> dict:
    from megaulysses.config import ModelConfig
    from megaulysses.training.load_rules import mask_of
    return {**mask_of(ModelConfig()), **kw}


def run_meta(**kw) -> dict:
    """A training run's trainer_state.json, as far as the mask goes."""
    return {"args": {"model": mask(**kw)}}


def check(saved: dict, now: dict, seq: int = 64):
    from megaulysses.training.load_rules import check_mask
    check_mask("ck", saved, now, seq)


def test_mask_rules(caplog):
    from megaulysses.config import CheckpointError
    fixed = dict(attention_sparsity="fixed", sparse_block_size=16, sparse_local_blocks=2)
    with pytest.raises(CheckpointError, match=r"^--attention-sparsity: ck was trained with "
                                              r"--attention-sparsity fixed --sparse-block-size 16 .* but this run has "
                                              r"--attention-sparsity dense"):
        check(run_meta(**fixed), mask())
    # the block size left at its default under the same layout: refused, naming it
    with pytest.raises(CheckpointError, match=r"^--sparse-block-size: .* pass "
                                              r"--sparse-block-size 16 "):
        check(run_meta(**fixed), mask(**{**fixed, "sparse_block_size": 64}))
    with caplog.at_level(logging.WARNING, "megaulysses.training.load_rules"):
        # block settings of a layout neither uses: nothing to say
        check(run_meta(sparse_block_size=16), mask())
        assert caplog.text == ""
        # a window as long as the sequence attends as full causal: logged only
        check(run_meta(window_size=64), mask(), seq=64)
        assert "this run has --window-size none, which attends alike at --seq-length 64" \
            in caplog.text
        caplog.clear()
        check(run_meta(**fixed), mask(**{**fixed, "sparse_local_blocks": 3}))  # given
        assert "--sparse-local-blocks 2; this run attends with --sparse-local-blocks 3" \
            in caplog.text
    # the same window 65 at --seq-length 128 is another function: refused
    with pytest.raises(CheckpointError, match="^--window-size: "):
        check(run_meta(window_size=64), mask(), seq=128)
    # an import records its window only; a Megatron-LM import none (nothing to compare)
    with pytest.raises(CheckpointError, match="^--window-size: "):
        check({"converted_from": {"window_size": 16}}, mask())
    check({"converted_from": {"window_size": None}}, mask())
    check({"converted_from": {"megatron_dir": "x"}}, mask(window_size=8))
