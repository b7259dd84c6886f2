"""No Megatron-LM flag that touches numerics, precision or memory is accepted "with no
effect" unless a reviewer can check why nothing observable differs (issue 39, part 3).

The table (config/megatron_table.py, read through config.megatron against the live schema)
is scanned: every "no effect" flag whose name or Megatron-LM help (megatron_args.json)
mentions one of WORDS must be in REVIEWED, with the reason it changes nothing here, pointing at what
shows it. A new such flag fails until it is implemented, refused or reviewed; an entry
that no longer applies (implemented, refused, renamed) fails too, so the list stays true.
"""

import re

WORDS = re.compile(r"precision|fp32|fp16|bf16|fp8|memory|numeric|accumulat|dtype", re.I)

# flag -> why nothing observable differs here (checkable: where it is so, or what the flag
# only selects in Megatron-LM).
REVIEWED = {
    "--attention-softmax-in-fp32": "already so: every attention kernel here takes the "
    "softmax of fp32 scores (model/attention/kernels.py math_attention upcasts q and k, "
    "block.py keeps its running max and sum in fp32; SDPA and flash accumulate in fp32)",
    "--use-precision-aware-optimizer": "Transformer Engine's optimizer, with its default "
    "dtypes (fp32 main params, grads and moments) the same math as here; the flags that "
    "lower them (--main-params-dtype, --exp-avg-dtype, ...) have rows of their own",
    "--record-memory-history": "a debugging dump of CUDA allocations (torch.cuda.memory's "
    "history) for one rank: what is allocated and computed is the same; --dry-run's plan "
    "and the logged mem_peak_gib say the memory here",
    "--memory-snapshot-path": "where --record-memory-history's dump goes (see it)",
    "--async-ckpt-use-cpu-shm": "how Megatron-LM's asynchronous save stages tensors; "
    "--async-save here has its own staging, and what is saved is the same",
    "--distrib-optim-fully-reshardable-mem-efficient": "a Megatron-LM checkpoint format's "
    "save strategy (gloo, one rank): checkpoints here have one format",
    "--ckpt-drop-redundant-extra-state": "Transformer Engine's FP8 extra state in Megatron-LM "
    "checkpoints: no such state exists here (FP8 is refused)",
    "--log-memory-to-tensorboard": "already so: every logged record writes mem_allocated_gib "
    "and mem_peak_gib to tensorboard (training/metrics.py memory_stats)",
    "--inprocess-empty-cuda-cache": "an option of NVIDIA's in-process restart, which is not "
    "used here (a lost rank ends the run)",
}

# Being implemented by another part of issue 39 (its row leaves the table when it lands):
# neither required nor refused here meanwhile. Empty this once they have landed.
PENDING: set = set()

# Were "no effect" until issue 39; each now does what it does in Megatron-LM, or is refused.
RE_JUDGED = ("--check-for-spiky-loss", "--check-for-large-grads", "--wandb-entity",
             "--distribute-saved-activations", "--empty-unused-memory-level",
             "--accumulate-allreduce-grads-in-fp32", "--ddp-bucket-size", "--ddp-num-buckets")


def no_effect_flags() -> dict:
    """flag -> (its name and Megatron-LM help, our reason), of the "no effect" rows."""
    from megaulysses.config import megatron
    return {flag: (f"{flag} {m.help or ''}", reason)
            for flag, (m, status, reason) in megatron.table_flags().items()
            if status == megatron.NO_EFFECT}


def test_no_numerics_or_memory_flag_is_silently_ignored():
    flagged = {flag for flag, (help_, _) in no_effect_flags().items()
               if WORDS.search(help_)} - PENDING
    assert flagged - set(REVIEWED) == set(), (
        "no effect, but Megatron-LM's help speaks of numerics, precision or memory: "
        "implement, refuse, or review it here with a checkable reason")
    assert set(REVIEWED) - flagged == set(), "reviewed but no longer a no-effect row"
    assert all(len(why) > 40 for why in REVIEWED.values())


def test_re_judged_flags_are_no_longer_no_effect():
    from megaulysses.config import megatron
    rows = megatron.table_flags()
    ours = megatron.schema_options()
    for flag in RE_JUDGED:
        assert flag in ours or rows[flag][1] == megatron.REFUSED, flag


def test_the_scan_sees_a_flag_it_should():
    """The words match what they are meant to (so an empty result means something)."""
    assert WORDS.search("Run attention masking and softmax in fp32.")
    assert WORDS.search("--empty-unused-memory-level Call torch.cuda.empty_cache() each "
                        "iteration (training and eval), to reduce fragmentation.")
    assert len(no_effect_flags()) > 100
