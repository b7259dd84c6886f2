"""--no-save-optim and --no-save-rng (Megatron-LM's): checkpoints without the optimizer
state or the RNG states. Loading one needs --no-load-optim / --no-load-rng, else one
line naming the flag to pass (exit 2), as Megatron-LM stops with its message."""

import json
import os

import pytest

from helpers import TINY, read_jsonl, train_losses

import pretrain_gpt

RUN = TINY + ["--train-iters", "2", "--eval-iters", "0", "--num-workers", "0"]


def main(args, tmp_path, name) -> int:
    return pretrain_gpt.main(RUN + list(args) + [
        "--data-cache-path", str(tmp_path / "cache"),
        "--metrics-jsonl", str(tmp_path / f"{name}.jsonl")])


def test_checkpoint_without_optimizer_and_rng(tmp_path, capfd):
    from torch.distributed.checkpoint import FileSystemReader
    ck = tmp_path / "ck"
    assert main(["--save", str(ck), "--no-save-optim", "--no-save-rng"], tmp_path, "save") == 0
    d = ck / "iter_0000002"
    meta = json.loads((d / "trainer_state.json").read_text())
    assert meta["contents"] == ["model"]
    assert not [f for f in os.listdir(d) if f.startswith("rng_rank")]
    keys = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    assert keys and all(k.startswith("model.") for k in keys), sorted(keys)[:5]
    capfd.readouterr()
    # Megatron-LM's rule: say how to go on without what is not there, one flag at a time.
    for flags, needed in (([], "--no-load-optim"), (["--no-load-optim"], "--no-load-rng")):
        assert main(["--load", str(ck)] + flags, tmp_path, "refused") == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {needed}: {d}"), err
        assert f"pass {needed}" in err[0]
    flags = ["--load", str(ck), "--no-load-optim", "--no-load-rng", "--train-iters", "3"]
    assert main(flags, tmp_path, "resumed") == 0
    assert sorted(train_losses(read_jsonl(tmp_path / "resumed.jsonl"))) == [3]


@pytest.mark.parametrize("flag,kept", [("--no-save-optim", "rng"), ("--no-save-rng", "optim")])
def test_each_flag_drops_only_its_part(tmp_path, flag, kept):
    """A checkpoint saved with one flag records the other part, and loads with only the
    matching --no-load flag."""
    ck, one = tmp_path / "ck", ["--train-iters", "1", "--lr-warmup-iters", "1"]
    assert main(["--save", str(ck), flag] + one, tmp_path, "save") == 0
    d = ck / "iter_0000001"
    meta = json.loads((d / "trainer_state.json").read_text())
    assert meta["contents"] == ["model", kept]
    assert bool([f for f in os.listdir(d) if f.startswith("rng_rank")]) == (kept == "rng")
    load = flag.replace("save", "load")
    assert main(["--load", str(ck), load] + one, tmp_path, "resumed") == 0  # loads: at its end
