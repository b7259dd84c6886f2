"""The run prints every resolved setting at start, one per line, under Megatron-LM's
argument names (config/summary.py), in the log and in --dry-run; and every unknown flag
of a command line is named in one error."""

import argparse
import re
import subprocess
import sys

from helpers import REPO, TINY

from megaulysses.config import build_parser, parse_args, resolve
from megaulysses.config.summary import format_settings

LINE = re.compile(r"^  (\w+) \.{2,} (.*)$")


def dumped(cfg) -> dict:
    return {m[1]: m[2] for m in map(LINE.match, format_settings(cfg).splitlines()) if m}


def test_every_flag_is_printed_resolved_under_its_megatron_name():
    i = TINY.index("--lr-warmup-iters")
    no_warmup = TINY[:i] + TINY[i + 2:]
    i = no_warmup.index("--lr-warmup-init")
    no_warmup = no_warmup[:i] + no_warmup[i + 2:]
    flags = no_warmup + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                         "--lr-warmup-fraction", "0.5", "--train-iters", "8",
                         "--global-batch-size", "8"]
    cfg = resolve(parse_args(flags), 4, 4096)
    rows = dumped(cfg)
    flags = {a.option_strings[0][2:].replace("-", "_") for a in build_parser()._actions
             if not isinstance(a, argparse._HelpAction) and a.dest != "group_query_attention"
             and a.help is not argparse.SUPPRESS}  # Megatron-LM's hidden ones: logged, if given
    # every flag's setting, under the flag's own (Megatron-LM's) name: --sequence-parallel
    # is `sequence_parallel` though the field is tp_sequence_parallel
    # the extra flags of a field print as the field's setting (--grad-reduce-in-bf16 as
    # grad_reduce_dtype)
    missing = flags - set(rows) - {"disable_bias_linear", "recompute_activations",
                                   "no_exit_signal_handler", "grad_reduce_in_bf16",
                                   "use_rotary_position_embeddings", "use_torch_fsdp2",
                                   "tokenizer_hf_no_include_special_tokens"}
    assert not missing, missing
    assert rows["sequence_parallel"] == "True"
    assert rows["lr_warmup_iters"] == "4"  # resolved: 0.5 of 8 iterations
    assert rows["lr_warmup_fraction"] == "0.5"  # as given (Megatron-LM prints it too)
    assert rows["world_size"] == "4" and rows["data_parallel_size"] == "2"
    assert rows["global_batch_size"] == "8" and rows["num_micro_batches"] == "2"
    assert rows["group_query_attention"] == "True" and rows["num_query_groups"] == "2"
    assert rows["padded_vocab_size"] == "4096" and rows["ffn_hidden_size"] == "128"  # Megatron-LM: int(8*64/3/64)*64


def test_dry_run_and_training_print_the_settings(tmp_path):
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--dry-run", *TINY,
                           "--data-cache-path", str(tmp_path / "c")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "------------------------ arguments ------------------------" in proc.stdout
    assert re.search(r"^  position_embedding_type \.+ rope$", proc.stdout, re.M)


def test_every_unknown_flag_is_named_in_one_line():
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--learning-rate", "1e-3",
                           "--seq", "32", "--num-layrs", "8"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    # (--num-experts, Megatron-LM's, is refused before: tests/test_megatron_compat.py)
    assert lines == ["error: --learning-rate/--seq/--num-layrs: 3 unrecognized "
                     "arguments; did you mean --seq-length or --sequence-parallel for --seq, "
                     "--num-layers for --num-layrs?"]


def test_megatron_values_and_habits_are_accepted(tmp_path):
    """--attention-backend fused (Megatron-LM's) runs as sdpa, unfused and local as math;
    --split with a script's quotes; --save-interval without --save saves nothing and goes
    on, with a warning (as in Megatron-LM)."""
    from megaulysses.data.gpt_dataset import parse_split
    assert parse_split("'99,1,0'") == parse_split('"99,1,0"') == parse_split("99,1,0")
    for theirs, ours in (("fused", "sdpa"), ("unfused", "math"), ("local", "math")):
        cfg = resolve(parse_args(TINY + ["--attention-backend", theirs]), 1, 4096)
        assert cfg.model.attention_backend == ours
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--mock-data",
                           "--train-iters", "2", "--eval-iters", "0", "--attention-backend",
                           "fused", "--split", "'99,1,0'", "--save-interval", "2",
                           "--use-mcore-models", "--transformer-impl", "local",
                           "--overlap-grad-reduce", "--use-distributed-optimizer",
                           "--data-cache-path",
                           str(tmp_path / "c")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "--attention-backend fused (Megatron-LM's) runs as sdpa here" in out
    assert "--save-interval 2 without --save: nothing is saved" in out
    assert "saved checkpoint" not in out
    for line in ("--use-mcore-models: accepted, no effect here (there is one GPT",
                 "--transformer-impl local: accepted, no effect here (it selects no kernels",
                 "--overlap-grad-reduce: accepted, no effect here (the bucketed gradient",
                 "--use-distributed-optimizer: ZeRO-1 under fp32"):
        assert out.count(line) == 1, line
    for theirs, ours, to in (("--grad-reduce-in-bf16", "grad_reduce_dtype", "bf16"),
                             ("--use-distributed-optimizer", "zero_stage", 1)):
        cfg = resolve(parse_args(TINY + [theirs]), 1, 4096)
        assert getattr(cfg.parallel, ours) == to, theirs
    deeper = resolve(parse_args(TINY + ["--use-distributed-optimizer", "--zero-stage", "3"]),
                     1, 4096)
    assert deeper.parallel.zero_stage == 3  # a higher stage shards more, and stays
