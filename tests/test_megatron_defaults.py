"""Issue 28, item 1: every flag Megatron-LM shares with us has Megatron-LM's default, read
from its arguments.py as data (megaulysses/config/megatron_args.json), except the ones
megatron_defaults.DIFFERENT_DEFAULTS names with the reason. And without a data source the
bundled run's preset applies, printed, and overridden by any flag given."""

import json
import os
from dataclasses import fields

from helpers import REPO

TABLE = os.path.join(REPO, "megaulysses", "config", "megatron_args.json")


def megatron_defaults() -> tuple[dict, dict]:
    """({flag: its entry}, {dest: the value argparse gives it when no flag sets it})."""
    with open(TABLE) as f:
        flags = json.load(f)["flags"]
    by_flag, by_dest = {}, {}
    for entry in flags:
        for name in [entry["flag"], *entry.get("aliases", [])]:
            for n in name.split("/"):
                by_flag[n] = entry
        by_dest.setdefault(entry["dest"], entry["default"])  # argparse: the first one's
    return by_flag, by_dest


def our_defaults() -> dict:
    from megaulysses.config import Config
    from megaulysses.config.schema import SECTIONS
    cfg = Config()
    return {f.name: getattr(getattr(cfg, s), f.name)
            for s, (cls, _) in SECTIONS.items() for f in fields(cls)}


def same(ours, theirs) -> bool:
    if theirs is None and ours is False:  # Megatron-LM's store_true with default=None
        return True
    if (theirs, ours) in (("", None), (None, "")):  # an empty name: off (--wandb-entity)
        return True
    if isinstance(ours, (int, float)) and not isinstance(ours, bool):
        return isinstance(theirs, (int, float)) and float(ours) == float(theirs)
    if isinstance(ours, tuple):
        ours = list(ours)
    return ours == theirs


def shared_actions():
    """(our action, Megatron-LM's entry) for every flag both parsers have."""
    from megaulysses.config import build_parser
    by_flag, _ = megatron_defaults()
    for action in build_parser()._actions:
        theirs = [by_flag[o] for o in action.option_strings if o in by_flag]
        if theirs:
            yield action, theirs[0]


def test_every_shared_default_is_megatrons():
    from megaulysses.config.megatron_defaults import DIFFERENT_DEFAULTS
    _, by_dest = megatron_defaults()
    ours = our_defaults()
    wrong, compared = [], 0
    for action, entry in shared_actions():
        flag = action.option_strings[0]
        if action.nargs == 0 and action.dest != entry["dest"]:
            # a switch that sets a field of another name (--grad-reduce-in-bf16 sets
            # grad_reduce_dtype): off unless given, on both sides
            continue
        if action.dest not in ours:  # an extra flag's own destination
            continue
        compared += 1
        if not same(ours[action.dest], by_dest[entry["dest"]]) and flag not in DIFFERENT_DEFAULTS:
            wrong.append(f"{flag}: ours {ours[action.dest]!r}, Megatron-LM's "
                         f"{by_dest[entry['dest']]!r}")
    assert not wrong, "defaults that differ from Megatron-LM's:\n" + "\n".join(wrong)
    assert compared > 60, compared  # the table is really read


def test_every_listed_difference_is_real():
    """DIFFERENT_DEFAULTS names only shared flags whose defaults do differ."""
    from megaulysses.config.megatron_defaults import DIFFERENT_DEFAULTS
    _, by_dest = megatron_defaults()
    ours = our_defaults()
    actions = {a.option_strings[0]: (a, e) for a, e in shared_actions()}
    for flag in DIFFERENT_DEFAULTS:
        assert flag in actions, f"{flag} is not shared with Megatron-LM"
        action, entry = actions[flag]
        assert not same(ours[action.dest], by_dest[entry["dest"]]), f"{flag} does not differ"


def test_megatron_gpt_defaults_build_gpt2_style():
    """The issue's example: a script that passes no architecture flag."""
    from megaulysses.config import parse_args
    cfg = parse_args(["--mock-data", "--train-iters", "12"])
    m, t = cfg.model, cfg.train
    assert (m.normalization, m.position_embedding_type, m.swiglu, m.add_bias_linear) == (
        "LayerNorm", "learned_absolute", False, True)
    assert (m.hidden_dropout, m.attention_dropout) == (0.1, 0.1)
    assert (t.lr_warmup_iters, t.lr_warmup_fraction, t.lr_decay_style) == (0, None, "linear")
    assert (t.eval_interval, t.eval_iters, cfg.log.log_interval) == (1000, 100, 100)
    assert cfg.preset is None


def test_no_data_source_is_the_bundled_preset_and_flags_override_it():
    from megaulysses.config import parse_args
    from megaulysses.config.presets import SHAKESPEARE, preset_lines
    cfg = parse_args([])
    assert cfg.preset == "shakespeare"
    for section, values in SHAKESPEARE.items():
        for k, v in values.items():
            assert getattr(getattr(cfg, section), k) == v, k
    cfg = parse_args(["--no-swiglu", "--lr-warmup-iters", "3", "--lr", "1e-4"])
    assert (cfg.model.swiglu, cfg.model.normalization) == (False, "RMSNorm")
    # the preset's warm-up fraction and min-lr yield to a warm-up and lr of one's own
    assert (cfg.train.lr_warmup_iters, cfg.train.lr_warmup_fraction) == (3, None)
    assert cfg.train.min_lr == 0.0
    line, = preset_lines(cfg)
    assert "'shakespeare' preset" in line and "swiglu=False" in line


def _settings(out: str) -> dict:
    """The `  name ........ value` lines of the arguments block."""
    return {line.split(" ..")[0].strip(): line.rsplit(" ", 1)[-1]
            for line in out.splitlines() if line.startswith("  ") and " .." in line}


def test_the_preset_is_in_the_log_and_the_dry_run(capsys):
    import pretrain_gpt
    assert pretrain_gpt.main(["--dry-run", "--num-layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "no --data-path or --mock-data: the bundled 'shakespeare' preset" in out
    settings = _settings(out)
    assert (settings["preset"], settings["normalization"], settings["num_layers"]) == (
        "shakespeare", "RMSNorm", "2")
    assert pretrain_gpt.main(["--dry-run", "--mock-data", "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", "500"]) == 0
    out = capsys.readouterr().out
    assert "preset (" not in out
    settings = _settings(out)
    assert (settings["preset"], settings["normalization"], settings["position_embedding_type"],
            settings["add_bias_linear"], settings["lr_warmup_iters"]) == (
        "None", "LayerNorm", "learned_absolute", "True", "0")
