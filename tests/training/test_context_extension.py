"""Context extension at --load: the RoPE base, its scaling, --seq-length and
--max-position-embeddings may change when a checkpoint is loaded (logged, recorded in the
new checkpoint); what changes a weight's meaning stays refused."""

import json
import logging

import pytest

from helpers import llama_config, run_inprocess, train_losses

NO_EVAL = ["--eval-iters", "0", "--train-iters", "2", "--save-interval", "2"]


def test_positions_may_change_shapes_may_not(caplog):
    from megaulysses.config import CheckpointError
    from megaulysses.training.load_rules import check_meta
    saved = {"model": llama_config(vocab_size=300, rotary_base=500000.0).shape_dict()}
    longer = llama_config(vocab_size=300, rotary_base=8e6, seq_length=1024,
                          max_position_embeddings=4096, use_rope_scaling=True,
                          rope_scaling_factor=4.0)
    with caplog.at_level(logging.INFO, "megaulysses.training.load_rules"):
        check_meta("ck", saved, {"model": longer.shape_dict()})
    line = " ".join(r.getMessage() for r in caplog.records)
    assert "context extension: ck was saved with --seq-length 256" in line
    assert "--rotary-base 500000.0" in line and "--rotary-base 8000000.0" in line
    assert "--use-rope-scaling True" in line and "--rope-scaling-factor 4.0" in line
    deeper = llama_config(vocab_size=300, rotary_base=8e6, num_layers=8)
    with pytest.raises(CheckpointError, match="was saved with --num-layers=6 but this "
                                              "run has 8"):
        check_meta("ck", saved, {"model": deeper.shape_dict()})
    # Learned positions are weights: their count cannot change.
    gpt2 = {"model": llama_config(vocab_size=300, position_embedding_type="learned_absolute",
                                  max_position_embeddings=256).shape_dict()}
    more = llama_config(vocab_size=300, position_embedding_type="learned_absolute",
                        max_position_embeddings=512)
    with pytest.raises(CheckpointError, match="--max-position-embeddings=256 but this run "
                                              "has 512"):
        check_meta("ck", gpt2, {"model": more.shape_dict()})


def test_an_older_checkpoint_without_the_new_keys_loads(caplog):
    """Keys added to the shape later take the value the field's default had then."""
    from megaulysses.training.load_rules import check_meta
    cfg = llama_config(vocab_size=300)
    old = {k: v for k, v in cfg.shape_dict().items()
           if k not in ("use_rope_scaling", "qk_layernorm", "add_qkv_bias", "rope_type")}
    with caplog.at_level(logging.INFO, "megaulysses.training.load_rules"):
        check_meta("ck", {"model": old}, {"model": cfg.shape_dict()})
    assert "context extension" not in caplog.text


def test_continue_at_twice_the_context_with_a_raised_base(tmp_path, caplog):
    ck, longer = tmp_path / "ck", tmp_path / "longer"
    run_inprocess(NO_EVAL + ["--save", str(ck), "--rotary-base", "10000"], tmp_path, "short")
    flags = NO_EVAL + ["--load", str(ck), "--save", str(longer), "--train-iters", "3",
                       "--seq-length", "64", "--rotary-base", "40000", "--use-rope-scaling",
                       "--rope-scaling-factor", "2", "--original-max-position-embeddings",
                       "32"]
    with caplog.at_level(logging.INFO, "megaulysses.training.load_rules"):
        losses = train_losses(run_inprocess(flags, tmp_path, "long"))
    assert sorted(losses) == [3]  # resumed at iteration 2, one step at the new length
    assert "context extension" in caplog.text and "--rotary-base 40000.0" in caplog.text
    meta = json.loads((longer / "iter_0000003" / "trainer_state.json").read_text())
    assert meta["model"]["rotary_base"] == 40000.0 and meta["model"]["seq_length"] == 64
    assert meta["model"]["use_rope_scaling"] is True
    assert meta["model"]["max_position_embeddings"] == 64
