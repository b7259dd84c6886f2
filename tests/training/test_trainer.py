"""Whole training runs through pretrain_gpt.main: accumulation, resume, precision, logs."""

import math
import os

import pytest

from helpers import run_inprocess, train_losses


def test_gradient_accumulation_equals_one_big_micro_batch(tmp_path):
    """gbs 4 as 4 micro-batches of 1 == 1 micro-batch of 4: the loss is the global token
    mean in both (with --eod-mask-loss the micro-batches hold different token counts, so
    only the per-token loss is independent of the micro-batch size)."""
    flags = ["--eod-mask-loss", "--calculate-per-token-loss"]
    one = train_losses(run_inprocess(["--micro-batch-size", "4"] + flags, tmp_path, "mbs4"))
    four = train_losses(run_inprocess(["--micro-batch-size", "1"] + flags, tmp_path, "mbs1"))
    assert sorted(one) == list(range(1, 7))
    for it in one:
        assert four[it] == pytest.approx(one[it], rel=1e-5), it  # fp32 summation order


def test_resume_gives_the_same_losses_bit_for_bit(tmp_path):
    """Stop at 3 (--exit-interval), resume to 6: iterations 4..6 equal the uninterrupted
    run exactly (fp32, CPU). Dropout on, so the restored RNG state matters too."""
    args = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full = train_losses(run_inprocess(args, tmp_path, "full"))
    ck = str(tmp_path / "ck")
    first = run_inprocess(args + ["--save", ck, "--exit-interval", "3"], tmp_path, "first")
    assert max(train_losses(first)) == 3
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read() == "3"
    second = train_losses(run_inprocess(args + ["--load", ck], tmp_path, "second"))
    assert sorted(second) == [4, 5, 6]  # iteration numbers continue
    for it in (4, 5, 6):
        assert second[it] == full[it], it


def test_metrics_jsonl_and_tensorboard(tmp_path):
    tb = tmp_path / "tb"
    recs = run_inprocess(["--tensorboard-dir", str(tb)], tmp_path)
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5, 6]
    for key in ("iteration", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device",
                "mfu", "consumed_samples", "mem_peak_gib"):
        assert all(key in r for r in train), key
    assert [r["iteration"] for r in evals] == [3, 6]
    assert train[-1]["consumed_samples"] == 6 * 4
    assert all(math.isfinite(r["loss"]) and r["tokens_per_sec"] > 0 for r in train)
    # Warmup over 2 iterations from --lr-warmup-init 1.5e-3, Megatron-LM's: iterations 1,
    # 2, 3 at the schedule's value where each starts (init, halfway, the peak); then decay.
    assert [r["lr"] for r in train[:3]] == pytest.approx([1.5e-3, 2.25e-3, 3e-3])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in train])
    assert len(acc.Scalars("eval_loss")) == 2


def test_bf16_trains(tmp_path):
    recs = train_losses(run_inprocess(["--bf16", "--train-iters", "8"], tmp_path))
    assert all(math.isfinite(v) for v in recs.values())
    assert recs[8] < recs[1]


def test_fp16_dynamic_loss_scale_skips_overflowing_steps(tmp_path):
    """A huge initial scale overflows fp16: those steps are skipped, counted and logged,
    the scale halves (hysteresis 1) until steps go through."""
    recs = run_inprocess(["--fp16", "--initial-loss-scale", str(2.0 ** 24), "--hysteresis",
                          "1", "--train-iters", "16", "--lr-warmup-iters", "0"], tmp_path)
    train = [r for r in recs if "loss" in r]
    skipped = train[-1]["skipped_iterations"]
    assert skipped >= 1
    assert train[-1]["loss_scale"] == 2.0 ** (24 - skipped)
    assert skipped < 12  # later steps do run
    assert train[-1]["loss"] < train[0]["loss"]


def test_mock_data_with_null_tokenizer(tmp_path):
    recs = train_losses(run_inprocess(["--mock-data", "--tokenizer-type", "NullTokenizer",
                                       "--vocab-size", "500", "--train-iters", "3"], tmp_path))
    assert sorted(recs) == [1, 2, 3]
    # Random tokens: the loss starts near ln(vocab) (501 ids + padding to 512).
    assert abs(recs[1] - math.log(512)) < 0.5


def test_blended_data_paths_and_a_freshly_preprocessed_dataset(tmp_path):
    """jsonl -> tools/preprocess_data.py -> Megatron .bin/.idx -> blended with the bundled
    corpus via `--data-path W1 A W2 B` -> trains."""
    import json
    import subprocess
    import sys
    from helpers import REPO
    src = tmp_path / "docs.jsonl"
    with open(src, "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"Document {i}: to be, or not to be. " * 8}) + "\n")
    tok = os.path.join(REPO, "data", "shakespeare_tok.model")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
                    "--input", str(src), "--output-prefix", str(tmp_path / "mine"),
                    "--json-keys", "text", "--tokenizer-type", "SentencePieceTokenizer",
                    "--tokenizer-model", tok, "--append-eod"], check=True, capture_output=True)
    bundled = os.path.join(REPO, "data", "shakespeare_text_document")
    recs = train_losses(run_inprocess(["--data-path", "0.3", str(tmp_path / "mine_text_document"),
                                       "0.7", bundled, "--split", "98,2,0", "--train-iters", "3"],
                                      tmp_path))
    assert sorted(recs) == [1, 2, 3] and all(math.isfinite(v) for v in recs.values())


def test_math_attention_backend_gives_the_same_losses_as_auto(tmp_path):
    auto = train_losses(run_inprocess(["--train-iters", "3"], tmp_path, "auto"))
    ref = train_losses(run_inprocess(["--train-iters", "3", "--attention-backend", "math"],
                                     tmp_path, "math"))
    for it in auto:
        assert auto[it] == pytest.approx(ref[it], rel=1e-5)
