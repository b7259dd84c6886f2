"""ZeRO-3's FSDP units of an untied model (parallel/zero_units.py): the embedding and the
head are units of their own, freed after their forward like a block, the root unit holds
nothing; a tied model keeps them in the root unit, gathered from forward to backward.

One spawn of tp2 x sp2 (DTensor parameters on a 2-D mesh, FSDP over the 2 sp ranks):
    - 10 fp32 steps of the untied model at ZeRO-3 equal one process (test_parity's
      tolerances: losses 1e-5 relative, final parameters 5e-5 absolute, grad norms);
    - one more step, watched (right after the run's last evaluation, whose forwards FSDP
      records and no backward consumes): after the forward nothing is gathered (embedding, head and
      blocks resharded: the rank holds its shards only); when the last block's backward
      starts, the head is resharded again (after its backward) and the embedding is not
      gathered, nor is it for its own backward; after the step all is sharded;
    - the step's all-gathers and reduce-scatters over dp x sp are the plan's (the head and
      each block gathered twice a micro-batch, the embedding once: after an evaluation
      FSDP's implicit prefetch would gather the head once more, zero_units.py);
    - the tied model: its root unit (embedding, final norm) is still gathered after the
      forward, and is resharded after the step.
"""

from dist import run_ranks
from helpers import read_jsonl
from test_parity import assert_same_run, one_process_runs, run_args
from test_pipeline import assert_grad_norms
from test_zero import train_one

UNTIED = ["--untie-embeddings-and-output-weights"]
GRID = ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2",
        "--zero-stage", "3"]


def _gathered(module):
    """Is this FSDP unit's parameter group gathered now? None: not a unit (or no params)."""
    get = getattr(module, "_get_fsdp_state", None)
    group = get()._fsdp_param_group if get is not None else None
    return None if group is None else group.is_unsharded


def watch_step(trainer) -> dict:
    """One more training step with probes: {moment: {unit: gathered?, "held": bytes of
    parameters held (Zero.held_bytes)}}, and the step's (group, kind) bytes."""
    import megaulysses.training.step as tr
    model, t = trainer.model, trainer.cfg.train
    units = {"embed": model.embed, "head": model.head, "root": model,
             **{f"layers.{i}": b for i, b in model.layers.items()}}
    seen = {}

    def snapshot(moment):
        seen[moment] = {name: _gathered(u) for name, u in units.items()}
        seen[moment]["held"] = trainer.zero.held_bytes()["params"]

    def on_last_block(module, args, out):  # the head's input: its gradient arrives
        out.register_hook(lambda grad: snapshot("last block backward"))  # after the head's

    def on_embed(module, args, out):  # its output's gradient: its own backward is next
        out.register_hook(lambda grad: snapshot("embedding backward"))

    hooks = [model.register_forward_hook(lambda *a: snapshot("after forward")),
             list(model.layers.values())[-1].register_forward_hook(on_last_block),
             model.embed.register_forward_hook(on_embed)]
    trainer.comm.stats.pop()
    tr.train_step(model, trainer.train_data.micro_batches(t.train_iters * t.global_batch_size),
                  trainer.zero, trainer.scaler, t.clip_grad, trainer.device, trainer.dtype,
                  trainer.comm, trainer.pipeline)
    sent = trainer.comm.stats.pop(by_group=True)
    for h in hooks:
        h.remove()
    snapshot("after step")
    return {"moments": seen, "sent": sent}


def train_and_watch(rank, world, untied_args, tied_args):
    from megaulysses.config import parse_args
    from megaulysses.parallel.dims import DP_SP, PP
    from megaulysses.parallel.pipeline import full_state_dict
    from megaulysses.planner.memory import plan_memory
    from megaulysses.training.trainer import Trainer
    trainer = Trainer(parse_args(untied_args))
    trainer.train()
    state = full_state_dict(trainer.model, trainer.comm)  # every rank takes part
    params = None if state is None else {k: v.numpy().copy() for k, v in state.items()}
    untied = watch_step(trainer)
    plan = plan_memory(trainer.cfg, trainer.dims, trainer.comm.rank(PP), "cpu")
    untied["planned"] = {k: v for k, v in plan.comm_by_group.items() if k[0] == DP_SP}
    untied["sent"] = {k: v for k, v in untied["sent"].items() if k[0] == DP_SP}
    tied = Trainer(parse_args(tied_args))
    return params, untied, watch_step(tied)["moments"]


def test_untied_embedding_and_head_are_units_resharded_after_forward(tmp_path):
    ref_records, ref_params = one_process_runs(tmp_path / "ref", {"untied": UNTIED},
                                               train_one)["untied"]
    path, untied_args = run_args(tmp_path, "z3", UNTIED, GRID)
    _, tied_args = run_args(tmp_path, "z3-tied", [], GRID)  # built, not trained
    results = run_ranks(train_and_watch, 4, untied_args, tied_args)

    records = read_jsonl(path)
    assert_same_run(records, ref_records, results[0][0], ref_params)
    assert_grad_norms(records, ref_records)
    for _, untied, tied in results:
        m = untied["moments"]
        after_step = m["after step"]
        assert after_step["root"] is None  # nothing left to the root unit
        for moment in ("after forward", "after step"):
            assert not any(v for k, v in m[moment].items() if k != "held"), (moment, m)
            assert m[moment]["held"] == after_step["held"]  # the shards, nothing gathered
        backward = m["last block backward"]
        assert backward["head"] is False and backward["embed"] is False, backward
        assert backward["layers.1"] is True  # (the block whose backward starts)
        assert m["embedding backward"]["embed"] is False  # its backward needs no weights
        for key in set(untied["sent"]) | set(untied["planned"]):
            got, want = untied["sent"].get(key, 0), untied["planned"].get(key, 0)
            assert abs(got - want) <= 1e-4 * want + 64, (key, got, want)
        # tied: embedding and head in the root unit, gathered from forward to backward
        assert tied["after forward"]["root"] is True and tied["after forward"]["embed"] is None
        assert tied["after forward"]["held"] > tied["after step"]["held"]
        assert tied["after step"]["root"] is False
