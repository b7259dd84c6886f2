"""--help (issue 15, item 7): every flag has help text and states its default exactly once.

A help text that explains a computed default in words ("default: 4*hidden") keeps it;
every other entry ends with "(default: X)", switches with on/off and unset values with
"none".
"""

import argparse
import re
import subprocess
import sys

from helpers import REPO

from megaulysses.config import build_parser


def help_entries(monkeypatch) -> dict:
    """option string -> its whole entry in --help (invocation and help on one line: the
    help is formatted wide enough not to wrap)."""
    monkeypatch.setenv("COLUMNS", "1000")  # argparse's width
    entries, current = {}, None
    for line in build_parser().format_help().splitlines():
        if line.startswith("  -"):  # an entry: "  --lr LR   peak learning rate ..."
            invocation = re.split(r"\s{2,}", line.strip())[0]
            current = [line.strip()]
            for part in invocation.split(", "):
                entries[part.split()[0]] = current
        elif line.startswith("   ") and current is not None:  # its help, on the next line
            current.append(line.strip())
        else:  # a group title or a blank line
            current = None
    return {option: " ".join(lines) for option, lines in entries.items()}


def flag_actions():
    # Megatron-LM's hidden flags are listed in docs/megatron_compat.md, not in --help
    return [a for a in build_parser()._actions if not isinstance(a, argparse._HelpAction)
            and a.help is not argparse.SUPPRESS]


def test_every_flag_has_help_and_says_its_default_once(monkeypatch):
    entries = help_entries(monkeypatch)
    actions = flag_actions()
    assert len(actions) > 80
    for action in actions:
        for option in action.option_strings:
            assert option in entries, option
        entry = entries[action.option_strings[0]]
        assert action.help and action.help.strip(), f"{action.option_strings[0]}: no help"
        count = len(re.findall(r"\bdefault\b", entry, flags=re.IGNORECASE))
        assert count == 1, f"'default' {count} times in: {entry}"


def test_the_default_shown_is_the_flags_default(monkeypatch):
    """Where the help does not explain the default in words, the value shown is the
    parser's: on/off for switches, none for an unset value, else the value itself."""
    entries = help_entries(monkeypatch)
    for action in flag_actions():
        if "default" in action.help.removesuffix(" (default: %(default)s)"):
            continue  # said in words, checked once above
        entry = entries[action.option_strings[0]]
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            shown = "on" if action.default else "off"
        elif action.nargs == 0:  # store_true, store_const: off unless the default is on
            on = action.default not in (None, False) and action.default == action.const
            shown = "on" if on else "off"
        else:
            shown = "none" if action.default is None else str(action.default)
        assert entry.endswith(f"(default: {shown})"), entry


def test_switches_show_on_or_off(monkeypatch):
    entries = help_entries(monkeypatch)
    assert entries["--bf16"].endswith("(default: off)")
    assert entries["--swiglu"].endswith("(default: off)")  # Megatron-LM's: GeLU
    assert entries["--add-bias-linear"].endswith("(default: on)")
    assert entries["--disable-bias-linear"].endswith("(default: off)")
    assert entries["--check-for-nan-in-loss-and-grad"].endswith("(default: on)")
    assert entries["--recompute-activations"].endswith("(default: off)")
    assert "default: on under SLURM" in entries["--exit-signal-handler"]


def test_help_exits_0():
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "--num-layers" in proc.stdout and "--dry-run-gpu" in proc.stdout
    assert "(default: 6)" in proc.stdout
