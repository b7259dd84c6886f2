"""Megatron-LM flags that were accepted "with no effect" and now do what they do there
(issue 39, part 3): --wandb-entity, --check-for-spiky-loss, --check-for-large-grads,
--empty-unused-memory-level."""

import pytest
import torch

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


# -- --check-for-spiky-loss, --check-for-large-grads --------------------------------------------

RUN = TINY + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
              "--eval-iters", "0", "--train-iters", "5", "--hidden-dropout", "0.1"]
SPIKE_AT = 4  # steps 2 and 3 set the maximum (samples=2; the first step is not looked at)


def spiked_trainer(args: list, checked: bool, spike: str, on_rank=None):
    """A trainer of `args` (+ the checks when `checked`) whose step SPIKE_AT has the head's
    normalized output multiplied by 1000 (loss and gradient norm far above 10x the
    maximum): "transient" in the step's first forward pass only (a device fault the rerun
    does not meet again), "persistent" in every pass, "none" never; on every rank holding
    the head, or on global rank `on_rank` only."""
    import torch.distributed as dist
    from megaulysses.config import parse_args
    from megaulysses.training.result_checks import ResultChecks
    from megaulysses.training.trainer import Trainer
    flags = ["--check-for-spiky-loss", "--check-for-large-grads"] if checked else []
    trainer = Trainer(parse_args(args + flags))
    if checked:  # Megatron-LM's rule on 2 samples instead of 100: a short test
        trainer.checks = ResultChecks(True, True, trainer.rank, samples=2)
    calls = []  # forward calls of the head's norm during the spiking step
    passes = trainer.cfg.train.global_batch_size // (
        trainer.cfg.train.micro_batch_size * trainer.dims.dp)  # micro-batches a pass

    def hook(module, args, out):
        if trainer.state.iteration + 1 != SPIKE_AT or spike == "none":
            return out
        calls.append(1)
        first_pass = len(calls) <= passes
        return out * 1000.0 if spike == "persistent" or first_pass else out

    here = on_rank is None or (dist.is_initialized() and dist.get_rank() == on_rank)
    if here and trainer.model.head is not None:
        trainer.model.head.norm.register_forward_hook(hook)
    trainer.spike_calls = calls
    return trainer


def train_with_spike(tmp_path, checked: bool, spike: str) -> dict:
    """5 steps of one process; the parameters at the end."""
    trainer = spiked_trainer(RUN + ["--data-cache-path", str(tmp_path / "c")], checked, spike)
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def test_a_transient_spike_is_rerun_and_trained_past(tmp_path, caplog):
    """The rerun's gradients step the optimizer: the run ends bit-equal to one that never
    saw the fault (CPU: the rerun draws the same dropout), and says it was transient."""
    import logging
    with caplog.at_level(logging.WARNING, "megaulysses.training.result_checks"):
        checked = train_with_spike(tmp_path, True, "transient")
    text = caplog.text
    assert f"iteration {SPIKE_AT}: unexpected result loss" in text
    assert "message='Spiky loss'" in text and "rerunning the step" in text
    assert "rerun: loss not reproducible within 0.0" in text and "transient error" in text
    clean = train_with_spike(tmp_path, False, "none")
    assert same(checked, clean)
    assert not same(train_with_spike(tmp_path, False, "transient"), clean)  # it can fail


def test_a_reproducible_spike_is_said_so_and_trained_with(tmp_path, caplog):
    import logging
    with caplog.at_level(logging.WARNING, "megaulysses.training.result_checks"):
        checked = train_with_spike(tmp_path, True, "persistent")
    assert "rerun: loss reproducible within 0.0" in caplog.text
    assert caplog.text.count("rerunning the step") == 1
    assert same(checked, train_with_spike(tmp_path, False, "persistent"))


GRIDS = {"dp2-zero3": ["--zero-stage", "3"], "pp2": ["--pipeline-model-parallel-size", "2"],
         "tp2": ["--tensor-model-parallel-size", "2"],
         # the fp32 gradient buffer that fused accumulation adds into, and overlapped gathers
         "dp2-distopt-bf16": ["--use-distributed-optimizer", "--bf16", "--overlap-grad-reduce",
                              "--overlap-param-gather"]}


def spikes_on_grids(rank, world, tmp) -> dict:
    """Per grid: (on rank 0, the max abs difference of the whole model after a transient
    spike on global rank 1 alone, checked, and after a clean run, unchecked; on rank 1, the
    forward passes the spiking step made there: 2 micro-batches each, a rerun's included)."""
    import logging

    from megaulysses.parallel.pipeline import full_state_dict
    logging.disable(logging.INFO)
    out = {}
    for name, flags in GRIDS.items():
        states = []
        for checked, spike in ((True, "transient"), (False, "none")):
            args = RUN + flags + ["--data-cache-path", f"{tmp}/c"]
            # rank 1 holds the head on every grid (pp2: the last stage)
            trainer = spiked_trainer(args, checked, spike, on_rank=1)
            trainer.train()
            states.append(full_state_dict(trainer.model, trainer.comm))
            if checked:
                passes = len(trainer.spike_calls)
        out[name] = passes if rank == 1 else max(
            (a - b).abs().max().item()
            for a, b in zip(states[0].values(), states[1].values(), strict=True))
    return out


def test_a_spike_on_one_rank_reruns_the_step_on_every_rank(tmp_path):
    """dp2 under ZeRO-3, pp2 (the head on the last stage), tp2, and dp2 with the
    distributed optimizer in bf16 (fused accumulation, overlapped reduce and gather): a
    transient spike in one rank's forward makes every rank run the step again (the
    decision is the global loss's and norm's, alike everywhere), and each grid ends
    bit-equal to its clean run."""
    from dist import run_ranks
    diffs, calls = run_ranks(spikes_on_grids, 2, str(tmp_path), timeout=300)
    assert diffs == {name: 0.0 for name in GRIDS}, diffs
    # the spiking rank's head ran its micro-batches twice: the step and its rerun (global
    # batch 4 of micro-batches of 2: dp2 1 a rank and pass; pp2, tp2 2)
    assert calls == {"dp2-zero3": 2, "pp2": 4, "tp2": 4, "dp2-distopt-bf16": 2}, calls


def test_large_grads_alone(tmp_path, caplog):
    """--check-for-large-grads without the loss check: its own message and tolerance."""
    import logging

    from megaulysses.training.result_checks import ResultChecks
    checks = ResultChecks(False, True, 0, samples=2)
    with caplog.at_level(logging.WARNING, "megaulysses.training.result_checks"):
        assert [checks.review(1e9, n, i + 1) for i, n in enumerate((5.0, 1.0, 2.0, 19.0))] \
            == [False, False, False, False]  # first step unseen; the loss not checked
        assert checks.review(1.0, 20.0, 5)  # 10 x the max of steps 2 and 3
        assert not checks.review(1.0, 20.01, 5)  # the rerun: within 0.001
    assert "message='found unexpected large grads'" in caplog.text
    assert "rerun: grad norm reproducible within 0.001" in caplog.text


# -- --empty-unused-memory-level ------------------------------------------------------------------

@pytest.mark.parametrize("level", [1, 2])
def test_empty_cache_at_megatron_points(tmp_path, monkeypatch, level):
    """torch.cuda.empty_cache() is counted (a spy on torch's function; CUDA said to be in
    use once the trainer is built): level 1 once per step (after its forward and backward
    passes) and per evaluation iteration, level 2 once more per step (after the optimizer),
    as Megatron-LM's train_step and evaluate."""
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    from helpers import read_jsonl
    jsonl = tmp_path / "m.jsonl"
    trainer = Trainer(parse_args(TINY + [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
        "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2",
        "--empty-unused-memory-level", str(level), "--metrics-jsonl", str(jsonl),
        "--data-cache-path", str(tmp_path / "c")]))
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    trainer.train()
    monkeypatch.undo()
    records = read_jsonl(jsonl)
    steps = sum("loss" in r for r in records)
    evals = 2 * sum("eval_loss" in r or "test_loss" in r for r in records)
    assert steps == 2 and evals >= 2
    assert len(calls) == {1: steps + evals, 2: 2 * steps + evals}[level]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_empty_cache_returns_the_unused_blocks_on_cuda():
    """What the level does there: after it, the caching allocator holds no more than the
    live tensors need (reserved memory falls to a few blocks above allocated)."""
    from megaulysses.training.step import empty_unused_memory
    device = torch.device("cuda")
    keep = torch.empty(2 ** 20, device=device)
    freed = torch.empty(64 * 2 ** 20, device=device)  # 256 MiB, then unused
    del freed
    before = torch.cuda.memory_reserved()
    empty_unused_memory(0, 1)
    assert torch.cuda.memory_reserved() == before  # level 0: nothing
    empty_unused_memory(1, 1)
    assert torch.cuda.memory_reserved() <= before - 64 * 2 ** 22 + 2 ** 22
    del keep
