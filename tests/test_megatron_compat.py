"""Megatron-LM's flags that pretrain_gpt.py has no flag of its own for (issue 28, item 5):
every one of them is in the parser or in config/megatron_table.py, no table row names a
flag the parser has, no-effect flags parse with Megatron-LM's arity and are logged once,
refused ones stop the run first with one line naming them all, docs/megatron_compat.md
is what tools/megatron_compat.py writes, and Megatron-LM's GPT-3 175B and Llama 3 8B
scripts parse (the Llama script's FP8 flags refused)."""

import argparse
import logging
import os
import sys

import pytest

from helpers import REPO

from megaulysses.config import ConfigError, build_parser, parse_args, resolve
from megaulysses.config import megatron
from megaulysses.config.megatron_table import (FLAGS, GROUPS, NO_EFFECT, PREFIXES, REFUSED,
                                               SAME_HERE)

sys.path.insert(0, os.path.join(REPO, "tools"))
import megatron_compat  # noqa: E402

BY_FLAG = {m.flag: m for m in megatron.megatron_flags()}
BY_NAME = {n: m for m in megatron.megatron_flags() for n in m.names}
MAIN = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # Megatron-LM's main, read by the generator


def our_options() -> set:
    """The parser's own option strings (Megatron-LM's table flags are hidden)."""
    return {o for a in build_parser()._actions if a.help is not argparse.SUPPRESS
            for o in a.option_strings}


def test_every_megatron_flag_is_in_the_parser_or_a_table():
    assert megatron.source().startswith("NVIDIA/Megatron-LM megatron/training/arguments.py")
    assert megatron.source().endswith(" @ " + MAIN)
    assert len([m for m in BY_FLAG.values() if not m.gone]) > 800
    missing = [m.flag for m, status, _ in megatron.status_rows() if status is None]
    assert not missing, f"Megatron-LM's {missing}: in neither the parser nor " \
                        "megaulysses/config/megatron_table.py"


def test_no_table_row_names_a_flag_of_the_parser():
    ours = our_options()
    for flag in FLAGS:
        assert flag in BY_NAME, f"{flag}: not a Megatron-LM flag (megatron_args.json)"
        assert not set(BY_NAME[flag].names) & ours, \
            f"{flag}: the parser has it now; remove its row from megatron_table.py"
    assert set(GROUPS) <= {m.group for m in BY_FLAG.values()}
    for prefix in PREFIXES:  # each names a family of flags that are not ours
        family = [m for m in BY_FLAG.values() if m.flag.startswith(prefix)]
        assert family and not {n for m in family for n in m.names} & ours, prefix
    assert all(FLAGS.get(f, (None,))[0] == REFUSED for f in SAME_HERE)


def test_docs_are_generated_from_the_code():
    with open(megatron_compat.DOC) as f:
        written = f.read()
    assert written == megatron_compat.render(), \
        "docs/megatron_compat.md is out of date: run python tools/megatron_compat.py --write"


def _values(m, restate: bool) -> list:
    """Command-line words for Megatron-LM's flag `m`: its default restated (`restate`;
    [] where it cannot be given) or a value that is not its default."""
    if m.action in ("store_true", "store_false"):
        return [] if restate else [m.flag]
    if m.action == "BooleanOptionalAction":
        return ["--no-" + m.flag[2:]] if restate else [m.flag]
    if restate:
        listed = isinstance(m.default, list)
        if m.default is None or (m.nargs is not None) != listed or m.default == []:
            return []
        return [m.flag, *map(str, m.default if listed else [m.default])]
    other = [c for c in m.choices or () if c not in (m.default, None, SAME_HERE.get(m.flag))]
    value = other[0] if other else {"int": (m.default or 0) + 1 if isinstance(
        m.default, int) else 1, "float": 0.5 if m.default != 0.5 else 0.25}.get(m.type, "x")
    return [m.flag, str(value)]


def _table(status: str) -> list:
    return [m for m, st, _ in megatron.table_flags().values() if st == status]


def test_no_effect_flags_parse_with_their_arity_and_are_logged_once(caplog):
    """Every no-effect flag at once (with a value not its default), and every refused flag
    restating Megatron-LM's default, parse; each is logged once by the run's start-up."""
    from megaulysses.training.run import log_megatron_meanings
    argv = [w for m in _table(NO_EFFECT) for w in _values(m, restate=False)]
    restated = [w for m in _table(REFUSED) for w in _values(m, restate=True)]
    for flag, value in SAME_HERE.items():
        restated += [flag, *(value if isinstance(value, list) else [value])]
    cfg = parse_args(["--mock-data", "--position-embedding-type", "rope", *argv, *restated])
    given = dict(cfg.compat.megatron_flags)
    assert set(given) == {m.flag for m in _table(NO_EFFECT)} | set(SAME_HERE) | {
        m.flag for m in _table(REFUSED) if _values(m, restate=True)}
    with caplog.at_level(logging.INFO):
        log_megatron_meanings(cfg, resolve(cfg, 1, 4096))
    for flag in given:
        lines = [r.message for r in caplog.records if r.message.startswith(flag + " ")
                 or r.message.startswith(flag + ":")]
        assert len(lines) == 1 and "accepted, no effect here (" in lines[0], (flag, lines)
    line = next(r.message for r in caplog.records if r.message.startswith("--rotary-percent"))
    assert line.startswith("--rotary-percent 1.0: accepted, no effect here (this value is "
                           "what runs here; other values ask for rotary embeddings on part")


def test_every_refused_flag_is_named_in_one_error():
    argv = [w for m in _table(REFUSED) for w in _values(m, restate=False)]
    with pytest.raises(ConfigError) as e:
        parse_args(["--mock-data", *argv])
    assert set(e.value.flag.split("/")) == {m.flag for m in _table(REFUSED)}


def test_a_refused_flag_stops_the_run_first_with_one_line(capfd):
    """Before the other flags are read: an unknown flag and a bad value are not named."""
    import pretrain_gpt
    capfd.readouterr()
    rc = pretrain_gpt.main(["--mock-data", "--hidden-size", "abc", "--fp8-format", "hybrid",
                            "--no-such-flag", "--num-experts=8", "--use-mcore-models"])
    out, err = capfd.readouterr()
    assert rc == 2 and "Traceback" not in out + err
    assert err.strip().splitlines() == [
        "error: --fp8-format/--num-experts: Megatron-LM's FP8 / FP4 training (--fp8-format); "
        "mixture of experts (--num-experts): not provided here"]  # in its --help order
    rc = pretrain_gpt.main(["--mock-data", "--rotary-percent", "0.5"])
    assert rc == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        "error: --rotary-percent: rotary embeddings on part of the head dimension "
        "(Megatron-LM's; not provided here)"]


GPT3_175B = [  # examples/gpt3/train_gpt3_175b_distributed.sh, data paths aside
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size", "16", "16",
    "5859375", "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9",
    "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
    "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
    "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--data-path", "DATA", "--vocab-file", "VOCAB", "--merge-file", "MERGES",
    "--split", "949,50,1", "--log-interval", "100", "--save-interval", "10000",
    "--eval-interval", "1000", "--save", "CK", "--load", "CK", "--eval-iters", "10",
    "--tensorboard-dir", "TB"]
LLAMA3_8B = [  # examples/llama/train_llama3_8b_h100_fp8.sh, mock data, no FP8
    "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096",
    "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--group-query-attention",
    "--num-query-groups", "8", "--kv-channels", "128", "--seq-length", "8192",
    "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm",
    "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
    "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015",
    "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
    "--data-cache-path", "CACHE", "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
    "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100",
    "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start", "4",
    "--profile-step-end", "6", "--ckpt-format", "torch_dist", "--distributed-timeout-minutes",
    "60", "--save", "CK", "--load", "CK", "--tensorboard-dir", "TB"]
LLAMA3_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
              "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]


@pytest.mark.parametrize("argv", [GPT3_175B, LLAMA3_8B], ids=["gpt3-175b", "llama3-8b"])
def test_megatron_scripts_parse(argv):
    """Every flag of the script is ours, or accepted (logged); nothing is refused."""
    ns = build_parser().parse_args(argv)  # no unknown flag, every value of its type
    megatron.refuse(megatron.given(ns))
    statuses = {m.flag: st for m, st, _ in megatron.status_rows()}
    ours = our_options()
    for flag in (w for w in argv if w.startswith("--")):
        assert flag in ours or statuses.get(flag) in (NO_EFFECT, REFUSED), flag


def test_the_llama_scripts_fp8_flags_are_refused():
    with pytest.raises(ConfigError) as e:
        megatron.refuse_first(LLAMA3_8B + LLAMA3_FP8, argparse.ArgumentParser(
            add_help=False, allow_abbrev=False))
    assert e.value.flag.split("/") == ["--fp8-format", "--fp8-amax-history-len",
                                       "--fp8-amax-compute-algo", "--fp8-param-gather"]


def test_a_deprecated_switch_is_accepted_beside_what_it_needs(capfd):
    """--no-position-embedding (Megatron-LM: deprecated, still accepted with rope, a
    RuntimeError otherwise): a fork's Llama script with rope runs; beside learned absolute
    positions the run stops naming the contradiction, on the line pretrain_gpt prints."""
    import pretrain_gpt
    cfg = parse_args(["--mock-data", "--position-embedding-type", "rope",
                      "--no-position-embedding"])
    assert cfg.model.position_embedding_type == "rope"
    assert dict(cfg.compat.megatron_flags) == {"--no-position-embedding": False}  # its dest
    capfd.readouterr()
    assert pretrain_gpt.main(["--mock-data", "--no-position-embedding"]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        "error: --no-position-embedding: Megatron-LM's deprecated switch needs "
        "--position-embedding-type rope, contradicted by --position-embedding-type "
        "learned_absolute (Megatron-LM stops too); use --position-embedding-type"]


def test_refusal_line_says_megatron_lms_once():
    """A reason that starts with "Megatron-LM's" is not prefixed again, alone or first."""
    for argv in (["--use-legacy-models"], ["--use-legacy-models", "--num-experts", "8"]):
        with pytest.raises(ConfigError) as e:
            parse_args(["--mock-data", *argv])
        assert "Megatron-LM's Megatron-LM's" not in str(e.value)
        assert str(e.value).count("Megatron-LM's") == 1, str(e.value)


def test_the_table_is_megatron_lms_main_with_the_2025_tables_history():
    """megatron_args.json is today's main (d98e8a64), dataclass-generated flags included,
    with today's defaults; the flags of the 000c4ac2 table that main no longer has are kept
    (a script of that time still parses as it did), each saying where it was last seen."""
    import json
    with open(megatron.ARGS_JSON) as f:
        doc = json.load(f)
    assert doc["previous"].endswith(" @ 000c4ac24f61159c138b0975def722c65245983c")
    gone = {m.flag: m for m in BY_FLAG.values() if m.gone}
    assert {m.gone for m in gone.values()} == {"000c4ac24f61159c138b0975def722c65245983c"}
    assert {"--use-legacy-models", "--hybrid-attention-ratio", "--retro-project-dir"} <= set(gone)
    assert not set(gone) & {n for m in BY_FLAG.values() if not m.gone for n in m.names}
    # generated from TransformerConfig / TrainingConfig fields, with today's values
    assert BY_FLAG["--mlp-chunks-for-training"].group == "transformer configuration"
    assert BY_FLAG["--tokenizer-hf-no-include-special-tokens"].default is False
    assert BY_FLAG["--profile-ranks"].default == []
    assert BY_FLAG["--no-tp-comm-overlap-ag"].aliases == ("--disable-tp-comm-overlap-ag",)
    assert BY_FLAG["--exit-signal"].default == "SIGTERM"  # an Enum's member, by name
    statuses = {m.flag: st for m, st, _ in megatron.status_rows()}
    assert statuses["--use-legacy-models"] == REFUSED  # a gone flag keeps its row
    assert statuses["--moe-router-topk"] == REFUSED  # a prefix row (PREFIXES)
    assert statuses["--no-tp-comm-overlap-ag"] == NO_EFFECT  # its 2025 name's row


def test_megatron_main_flags_added_since_2025_parse_or_are_refused_by_name():
    """A newer script's flags: one implemented under another name of ours, a no-effect one
    logged, a refused one named, a prefix family's refused."""
    cfg = parse_args(["--mock-data", "--mlp-chunks-for-training", "2",
                      "--flash-attention-version", "3"])
    assert cfg.memory.tiled_mlp_chunks == 2
    assert dict(cfg.compat.megatron_flags) == {"--flash-attention-version": 3}
    with pytest.raises(ConfigError) as e:
        parse_args(["--mock-data", "--use-mup", "--moe-router-topk", "4"])
    assert e.value.flag == "--use-mup/--moe-router-topk"
    assert "maximal update parametrization" in str(e.value) and "mixture of experts" in \
        str(e.value)
    parse_args(["--mock-data", "--moe-router-topk", "2"])  # Megatron-LM's default: nothing


def test_the_generator_reads_a_parser_and_keeps_the_history(tmp_path):
    """tools/megatron_args.py on a small parser built here the way Megatron-LM's
    ArgumentGroupFactory builds one (an Enum field, a --no-X/--disable-X switch): the
    records megatron.py reads; then a new table against an old one keeps the old one's
    flags that are gone, with the commit that last had them, and keeps them when the
    new table is written again from the same commit."""
    import argparse
    import enum
    import megatron_args as gen

    class Backend(enum.Enum):
        flash, local = 1, 2

    p = argparse.ArgumentParser()
    g = p.add_argument_group(title="transformer configuration")
    g.add_argument("--attention-backend", type=lambda s: Backend[s], choices=list(Backend),
                   default=Backend.flash, help="Backend. More words.")
    g.add_argument("--no-rope-fusion", "--disable-rope-fusion", action="store_false",
                   dest="apply_rope_fusion", help="Disable the fusion.")
    records = [gen.action_record(a, "transformer configuration") for a in p._actions[1:]]
    assert records[0] == {"flag": "--attention-backend", "aliases": [], "dest":
                          "attention_backend", "default": "flash", "action": None,
                          "type": "str", "nargs": None, "choices": ["flash", "local"],
                          "group": "transformer configuration", "help": "Backend."}
    assert (records[1]["aliases"], records[1]["action"], records[1]["nargs"]) == (
        ["--disable-rope-fusion"], "store_false", None)
    old = {"source": "X @ 000c4ac2", "flags": [
        {**records[1], "flag": "--disable-rope-fusion", "aliases": []},  # renamed: kept
        {**records[0], "flag": "--use-legacy-models"}]}  # gone
    gone = gen.gone_flags(old, records)
    assert [(g["flag"], g["last"]) for g in gone] == [("--use-legacy-models", "000c4ac2")]
    again = gen.gone_flags({"source": "X @ main", "flags": records, "gone": gone}, records)
    assert again == gone


def test_a_forks_llama3_script_runs_as_written():
    """The issue's example: a Llama 3 script of a ROCm fork adds the deprecated
    --no-position-embedding (beside rope) and --dataloader-type cyclic to Megatron-LM's own:
    parsed, nothing refused, the cyclic sampler chosen."""
    cfg = parse_args(LLAMA3_8B + ["--no-position-embedding", "--dataloader-type", "cyclic"])
    assert (cfg.model.position_embedding_type, cfg.data.dataloader_type) == ("rope", "cyclic")
    assert "--no-position-embedding" in dict(cfg.compat.megatron_flags)
