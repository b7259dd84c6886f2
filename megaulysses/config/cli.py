"""The command line, generated from the schema: every field's `option(...)` metadata
becomes its flag(s), in the schema's order, under its help group. Megatron-LM's names.

`parse_args(argv)` returns the flags as given (a frozen `Config`) after `rules.validate`;
any inconsistency raises `ConfigError(flag, rule)`, which `pretrain_gpt.py` prints as one
line and turns into exit code 2. Nothing else in the package parses flags.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from dataclasses import MISSING, Field, fields, replace
from typing import Any, Callable, Optional, Sequence

from megaulysses.config import megatron
from megaulysses.config.checkpoint_args import CheckpointModel, apply_checkpoint_args
from megaulysses.config.errors import ConfigError
from megaulysses.config.rules import validate
from megaulysses.config.fields import Flag
from megaulysses.config.presets import SHAKESPEARE, apply_preset, preset_for
from megaulysses.config.groups import COMPAT, GROUPS
from megaulysses.config.schema import SECTIONS, Config, megatron_window


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are ConfigErrors: one line naming the flag, exit 2, printed by
    rank 0 only."""

    def error(self, message):
        if message.startswith("argument ") and ": " in message:
            flag, rule = message[len("argument "):].split(": ", 1)
            raise ConfigError(flag.split("/")[0], rule)
        if message.startswith("unrecognized arguments: "):
            raise self._unrecognized(message.split(": ", 1)[1].split())
        raise ConfigError("pretrain_gpt.py", message)

    def _unrecognized(self, words: list[str]) -> ConfigError:
        """Every unknown flag in one line (a long script is fixed in one go), each with
        the flags it may have meant; values of unknown flags are not flags."""
        flags = [w for w in words if w.startswith("-") and not _is_number(w)]
        if not flags:
            return ConfigError(words[0], "unrecognized argument (pretrain_gpt.py takes flags "
                               "only)")
        close = {f: self._close(f) for f in flags}
        if len(flags) == 1:
            hint = f"; did you mean {' or '.join(close[flags[0]])}?" if close[flags[0]] else ""
            return ConfigError(flags[0], "unrecognized argument" + hint)
        hints = [f"{' or '.join(c)} for {f}" for f, c in close.items() if c]
        return ConfigError("/".join(flags), f"{len(flags)} unrecognized arguments" + (
            f"; did you mean {', '.join(hints)}?" if hints else ""))

    def _close(self, word: str) -> list[str]:
        # Megatron-LM's hidden flags (config/megatron.py) are not suggested
        names = [o for a in self._actions if a.help is not argparse.SUPPRESS
                 for o in a.option_strings if o.startswith("--")]
        # Abbreviations are refused (as in Megatron-LM): name the flags it abbreviates.
        return [n for n in names if n.startswith(word)] or difflib.get_close_matches(
            word, names, n=3, cutoff=0.7)

    def _parse_optional(self, arg_string):
        # argparse reads "-inf", "-1e-3" as unknown options (its negative-number test knows
        # only forms like -1 and -.5); as values they reach the flag's own check, which
        # names the flag.
        if _is_number(arg_string):
            return None
        return super()._parse_optional(arg_string)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, said once: " (default: X)" is appended
    unless the text already says it in words (e.g. "default: 4*hidden"); switches show
    on/off, and None shows as "none"."""

    def _get_help_string(self, action):
        # Python < 3.12 has BooleanOptionalAction add its own "(default: ...)": ours instead.
        text = (action.help or "").removesuffix(" (default: %(default)s)")
        if action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.nargs == 0:  # a switch: store_true/false/const, --x/--no-x
            given = action.default not in (None, False) and (
                isinstance(action, argparse.BooleanOptionalAction)
                or action.default == getattr(action, "const", object()))
            return f"{text} (default: {'on' if given else 'off'})"
        if action.default is None:
            return f"{text} (default: none)"
        return text + " (default: %(default)s)"


def positive_int(name: str) -> Callable[[str], int]:
    """argparse type: an integer > 0 (`name` is the flag, for callers' readability)."""
    def check(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
        return v
    return check


def finite_float(text: str) -> float:
    """argparse type: a finite number. nan and inf pass every `x > 0` check and then poison
    a run (an inf learning rate or epsilon trains NaNs), so no flag takes them."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def window_size(text: str) -> Optional[int]:
    """argparse type of --window-size: ours, W > 0, or Megatron-LM's "L,R" / "(L,R)"."""
    parts = text.strip("()").split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer W or Megatron-LM's L,R, got "
                                         f"{text!r}") from None
    if len(values) == 1:
        return positive_int("--window-size")(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"must be W or L,R (two integers), got {text!r}")
    try:
        return megatron_window(*values)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _gpu_name(text: str) -> str:
    """argparse type: a GPU of the planner's table (megaulysses/hardware.py)."""
    from megaulysses.hardware import UnknownGPU, gpu_spec
    try:
        return gpu_spec(text).name
    except UnknownGPU as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_ACTIONS = {"optional": argparse.BooleanOptionalAction}


def _type(kind: Optional[str], flag: str) -> Optional[Callable[[str], Any]]:
    return {None: None, "positive": positive_int(flag), "number": finite_float, "int": int,
            "gpu": _gpu_name, "window": window_size}[kind]


def _default(f: Field) -> Any:
    if f.default_factory is not MISSING:  # the schema's list defaults
        return f.default_factory()
    return f.default


def _add_flag(group, f: Field, flag: Flag, default: Any) -> None:
    names = flag.names or ("--" + f.name.replace("_", "-"),)
    kw = {"dest": flag.dest or f.name, "default": default, "help": _with_preset(f, flag)}
    if flag.action is not None:
        kw["action"] = _ACTIONS.get(flag.action, flag.action)
    optional = {"type": _type(flag.kind, names[0]), "choices": flag.choices,
                "nargs": flag.nargs, "const": flag.const, "metavar": flag.metavar}
    kw.update({k: v for k, v in optional.items() if v is not None})
    group.add_argument(*names, **kw)


_BUNDLED = {k: v for values in SHAKESPEARE.values() for k, v in values.items()}


def _with_preset(f: Field, flag: Flag) -> str:
    """The help, plus the bundled run's value where its preset sets the field."""
    if flag.dest or f.name not in _BUNDLED or f.name == "data_path":
        return flag.help
    return f"{flag.help}; the bundled run (no data source): {_BUNDLED[f.name]}"


def build_parser() -> argparse.ArgumentParser:
    """Every field with an `option` becomes its flags, in the schema's order."""
    # allow_abbrev=False as in Megatron-LM: "--hidden 64" is an error, not --hidden-size.
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT (Megatron-LM flag names). "
                "Defaults are Megatron-LM's; without --data-path or --mock-data: the bundled run "
                "(a small Llama-style model on the Shakespeare corpus in data/, whose settings "
                "each flag's help names).", formatter_class=_HelpFormatter,
                allow_abbrev=False, epilog="Megatron-LM's other flags are accepted with no "
                "effect (each logged once, with the reason) or refused with the reason: "
                "docs/megatron_compat.md lists every one.")
    groups = {title: p.add_argument_group(title) for title in GROUPS}
    for cls, title in SECTIONS.values():
        # by help group, then the schema's order: ModelConfig's inherited RoPE fields
        # (schema_rope.py) come after the model's own in the usage line too
        for f in sorted(fields(cls), key=lambda f: GROUPS.index(f.metadata.get("group")
                                                                or title)):
            for i, flag in enumerate(f.metadata.get("flags", ())):
                # the field's own flag has its default; extra flags have their own
                default = _default(f) if i == f.metadata["main"] else flag.default
                _add_flag(groups[f.metadata["group"] or title], f, flag, default)
    megatron.add_flags(groups[COMPAT])  # Megatron-LM's other flags, hidden from --help
    return p


def _pick(cls: type, ns: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if "flags" in f.metadata})


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The parser destinations the command line sets (whatever the value): parsed again
    with every default suppressed, so only what was given is left."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def parse_args(argv: Optional[Sequence[str]] = None,
               checkpoint_model: Optional[CheckpointModel] = None) -> Config:
    """The flags as given, checked by every rule that needs no world size or tokenizer;
    without a data source, the bundled run's preset in place of the defaults not given.
    `checkpoint_model` reads --use-checkpoint-args' model flags from a --load checkpoint."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Megatron-LM's flags for what is not provided here stop the run first, all named
    megatron.refuse_first(argv, _Parser(prog="pretrain_gpt.py", add_help=False,
                                        allow_abbrev=False))
    ns = build_parser().parse_args(argv)
    given = given_dests(build_parser(), argv)
    given = apply_checkpoint_args(ns, given, checkpoint_model)
    if ns.num_query_groups is not None and not ns.group_query_attention:
        raise ConfigError("--num-query-groups", "needs --group-query-attention")
    if ns.group_query_attention and ns.num_query_groups is None:
        ns.num_query_groups = 1  # Megatron's default: multi-query attention
    if "tokenizer_type" not in given and ns.vocab_file and ns.merge_file:
        # Megatron-LM's GPT scripts give the GPT-2 files alone (its GPT-3 175B example)
        ns.tokenizer_type = "GPT2BPETokenizer"
    cfg = Config(**{name: _pick(cls, ns) for name, (cls, _) in SECTIONS.items()})
    cfg = replace(cfg, compat=replace(cfg.compat, megatron_flags=megatron.given(ns)))
    preset = preset_for(given)
    if preset:
        cfg = apply_preset(cfg, preset, given)
    megatron.check_needs(cfg)  # Megatron-LM's deprecated switches beside what they need
    validate(cfg)
    return cfg
