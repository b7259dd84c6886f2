"""Megatron-LM flags that were accepted "with no effect" and now do what they do there
(issue 39, part 3): --wandb-entity, --check-for-spiky-loss, --check-for-large-grads,
--empty-unused-memory-level."""

import pytest

from helpers import TINY


@pytest.mark.parametrize("entity", ["team-x", ""])
def test_wandb_entity_reaches_wandb_init(tmp_path, monkeypatch, entity):
    """Offline: the wandb run's entity is the flag's; without the flag ('', Megatron-LM's
    default) none, which wandb takes as the API key's default entity. (The offline run
    file is not read back: wandb writes its run record asynchronously, not always before
    finish() returns.)"""
    from megaulysses.config import parse_args
    from megaulysses.training.wandb_writer import open_wandb
    for var in ("WANDB_MODE", "WANDB_API_KEY", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key: offline
    flags = ["--wandb-entity", entity] if entity else []
    cfg = parse_args(TINY + ["--mock-data", "--wandb-project", "p", "--wandb-exp-name", "e",
                             "--wandb-save-dir", str(tmp_path / "w"), *flags])
    assert cfg.log.wandb_entity == entity
    writer = open_wandb(cfg)
    try:
        assert (writer.run.entity or "") == entity
    finally:
        writer.close()
