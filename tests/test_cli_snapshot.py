"""The command line is a contract: `--help` (every flag, its group, order, help text and
default) and what each flag stores (dest, default, const, choices, nargs, action) must match
the committed snapshots in tests/snapshots/. A deliberate change of a flag regenerates them:

    python tests/test_cli_snapshot.py --write

and the diff is reviewed with the change.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HELP = os.path.join(HERE, "snapshots", "cli_help.txt")
ACTIONS = os.path.join(HERE, "snapshots", "cli_actions.json")


def _help_text() -> str:
    os.environ["COLUMNS"] = "1000"  # argparse's width: one line per entry, no wrapping
    from megaulysses.config import build_parser
    return build_parser().format_help()


def _actions() -> list:
    from megaulysses.config import REPO_ROOT, build_parser
    rows = []
    for a in build_parser()._actions:
        if isinstance(a, argparse._HelpAction) or a.help is argparse.SUPPRESS:
            continue  # Megatron-LM's hidden flags: docs/megatron_compat.md is their snapshot
        default = repr(a.default).replace(REPO_ROOT, "<repo>")  # the bundled files' paths
        rows.append({"flags": list(a.option_strings), "dest": a.dest, "default": default,
                     "const": repr(a.const), "choices": None if a.choices is None
                     else [repr(c) for c in a.choices], "nargs": a.nargs,
                     "action": type(a).__name__, "typed": a.type is not None})
    return rows


def test_help_matches_snapshot(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    with open(HELP) as f:
        assert _help_text() == f.read()


def test_flag_actions_match_snapshot():
    with open(ACTIONS) as f:
        assert _actions() == json.load(f)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    with open(HELP, "w") as f:
        f.write(_help_text())
    with open(ACTIONS, "w") as f:
        json.dump(_actions(), f, indent=1)
        f.write("\n")
    print(f"wrote {HELP} and {ACTIONS}")
