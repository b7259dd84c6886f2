"""Activation offload (--cpu-offloading-num-layers N) moves what full recomputation keeps to
host memory and back; it never changes what a step computes.

One process, fp32, dropout on: losses and every gradient are bit-identical with 0, some
and all layers offloaded, and the live-bytes tracker counts exactly the offloaded group
inputs as host bytes, apart from (and gone from) the device bytes.

Grids (real gloo ranks, one spawn of 8 for both): pp2 x tp2 x sp2 at ZeRO-3 with dropout,
and Ulysses x Ring (sp2 x cp2) x dp2 at ZeRO-3 with groups of 2 layers: every iteration's
loss and eval loss equal bit for bit with and without offload.
"""

import torch

from dist import run_ranks
from helpers import TINY, read_jsonl

BASE = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--num-layers", "4", "--vocab-size", "512", "--tokenizer-type", "NullTokenizer",
        "--recompute-granularity", "full", "--hidden-dropout", "0.1"]


def _one_process(offload: int):
    """(losses, flat gradients, device/host bytes kept after forward) of one step."""
    from megaulysses.config import parse_args, resolve
    from megaulysses.model.attention import select_backend
    from megaulysses.model.gpt import build_model
    from megaulysses.parallel.recompute import apply_recompute
    from megaulysses.training.live_bytes import LiveBytes
    cfg = resolve(parse_args(BASE + ["--cpu-offloading-num-layers", str(offload)]), 1, 512)
    _, core = select_backend("auto", torch.device("cpu"))
    model = build_model(cfg.model, core, seed=0)
    m = cfg.memory
    apply_recompute(model, m.recompute_granularity, m.recompute_method,
                    m.recompute_num_layers, offload_layers=offload)
    torch.manual_seed(0)  # the same dropout masks in every run
    tokens = torch.randint(0, 512, (2, 64))
    with LiveBytes() as live:
        losses = model(tokens, labels=tokens)
        kept = (live.current, live.host_current)
        losses.sum().backward()
        assert live.host_current == 0  # every host copy is freed by backward
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return losses.detach(), grads, kept


def test_inputs_come_back_ahead_of_their_recomputation(monkeypatch):
    """The last group's input is fetched when its recomputation asks for it; every earlier
    one is already on its way (started by the next group's attention-output gradient)."""
    from megaulysses.parallel.activation_offload import Held
    ready, get = [], Held.get

    def recording_get(self):
        if self.host is not None:  # the recomputation's call
            ready.append((self.index, self.device is not None))
        return get(self)

    monkeypatch.setattr(Held, "get", recording_get)
    _one_process(4)
    assert ready == [(3, False), (2, True), (1, True), (0, True)]


def test_offload_is_exact_and_counted_as_host_bytes():
    ref_losses, ref_grads, (ref_device, ref_host) = _one_process(0)
    assert ref_host == 0
    one_input = 2 * 64 * 64 * 4  # a group's input: [b, s, h] fp32
    for n in (2, 4):
        losses, grads, (device, host) = _one_process(n)
        assert torch.equal(losses, ref_losses) and torch.equal(grads, ref_grads)
        assert host == n * one_input
        assert device == ref_device - n * one_input


GRIDS = {
    "pp2-tp2-sp2-zero3": ["--pipeline-model-parallel-size", "2",
                          "--tensor-model-parallel-size", "2",
                          "--ds-sequence-parallel-size", "2", "--hidden-dropout", "0.1"],
    "sp2-cp2-dp2-zero3": ["--ds-sequence-parallel-size", "2", "--context-parallel-size", "2",
                          "--recompute-num-layers", "2"],
}


def _train(rank, world, runs):
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    for args in runs:
        Trainer(parse_args(args)).train()


def test_offload_is_exact_on_grids(tmp_path):
    common = TINY + ["--num-layers", "4", "--zero-stage", "3", "--recompute-granularity",
                     "full", "--train-iters", "3", "--eval-interval", "3",
                     "--data-cache-path", str(tmp_path / "cache")]
    runs, paths = [], {}
    for name, flags in GRIDS.items():
        for offload in ("0", "2"):
            path = str(tmp_path / f"{name}-{offload}.jsonl")
            paths[name, offload] = path
            runs.append(common + flags + ["--cpu-offloading-num-layers", offload,
                                          "--metrics-jsonl", path])
    run_ranks(_train, 8, runs)
    for name in GRIDS:
        plain, offloaded = (read_jsonl(paths[name, o]) for o in ("0", "2"))
        pick = lambda recs: [(r.get("iteration"), r.get("loss"), r.get("eval_loss"))
                             for r in recs if "loss" in r or "eval_loss" in r]
        assert len(pick(plain)) >= 4, name
        assert pick(offloaded) == pick(plain), name  # bit for bit
