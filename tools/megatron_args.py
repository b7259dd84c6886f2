"""Megatron-LM's flags as data: megaulysses/config/megatron_args.json. Nothing is
downloaded; the JSON is committed and megaulysses/config/megatron.py reads it at run time.

    python tools/megatron_args.py --source CHECKOUT --commit SHA [--previous OLD.json]
    python tools/megatron_args.py PATH/TO/arguments.py --commit SHA

One object per flag, in the order Megatron-LM's --help lists them: the flag, its aliases
(its other option strings; --no-X for a BooleanOptionalAction), dest, default, action,
type, nargs, choices, its argparse group's title and the first sentence of its help.

Two readers, for two generations of Megatron-LM:
- `--source CHECKOUT` (today's main, read at d98e8a64): most flags are generated from its
  config dataclasses (TransformerConfig, TrainingConfig, CheckpointConfig, ... through its
  ArgumentGroupFactory: a field's type, default and docstring make the flag), so the only
  faithful reader is its own parser: Megatron-LM's `add_megatron_arguments` is imported
  from CHECKOUT (its megatron/ directory, first on sys.path, ahead of any installed
  megatron-core) and run on an empty parser, and the parser's actions are written out.
  GPU-only packages it imports at module level (triton) are stubbed where not installed:
  they define kernels, no flag. Enum-typed flags take a member's name (its
  ArgumentGroupFactory parses `Enum[name]`): choices and defaults are written as names.
- `arguments.py` alone (up to commit 000c4ac2, the table of 2024-2025): every flag was a
  literal `add_argument` call, read with `ast`, nothing imported or run.

History: `--previous` (default: the committed JSON) is the table this one replaces. Its
flags that today's main no longer has are kept in "gone", each with the commit that last
had it, so a script written for that version still parses as before (megatron.py treats
them as Megatron-LM flags; docs/megatron_compat.md lists them apart), and the run prints
how many were added and gone.
"""
from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re
import sys
from typing import Any, Optional

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "megaulysses", "config", "megatron_args.json")

# Values Megatron-LM computes from its own enums: written out here (megatron/core).
ENUM_VALUES = {
    "AttnBackend.auto": "auto",
    "list(AttnBackend)": ["flash", "fused", "unfused", "local", "auto"],
    "[e.value for e in StrictHandling]": [
        "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
        "return_unexpected", "return_all", "ignore_all"],
}
_ARITHMETIC = {ast.Pow: operator.pow, ast.Mult: operator.mul, ast.Add: operator.add,
               ast.Sub: operator.sub}


def value(node: Optional[ast.expr]) -> Any:
    """A default or choices expression as JSON: a literal, arithmetic on literals,
    range(...), int(os.getenv(NAME, DEFAULT)) (its fallback), or an ENUM_VALUES entry."""
    if node is None:
        return None
    text = ast.unparse(node)
    if text in ENUM_VALUES:
        return ENUM_VALUES[text]
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](value(node.left), value(node.right))
    if isinstance(node, ast.Call) and text.startswith("range("):
        return list(range(*(value(a) for a in node.args)))
    if isinstance(node, ast.Call) and text.startswith("int(os.getenv("):
        getenv = node.args[0]
        assert isinstance(getenv, ast.Call)  # the text says so
        return int(value(getenv.args[1]))
    raise ValueError(f"line {node.lineno}: cannot read {text!r} as a value")


def text_of(node: ast.expr) -> str:
    """A help expression as text: string literals, their concatenation, f-strings (their
    fields as written), %-formatting and .format left as written."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return text_of(node.left) + text_of(node.right)
    if isinstance(node, ast.JoinedStr):
        return "".join("{" + ast.unparse(v.value) + "}" if isinstance(v, ast.FormattedValue)
                       else text_of(v) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return text_of(node.left)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return text_of(node.func.value)
    return ast.unparse(node)


def first_sentence(text: str) -> str:
    """Up to the first '. ' that does not end an abbreviation (e.g., i.e., etc.)."""
    text = re.sub(r"\s+", " ", text).strip().replace("%%", "%")
    for m in re.finditer(r"\. ", text):
        before = text[:m.start() + 1]
        if not re.search(r"(\be\.g|\bi\.e|\betc|\bvs)\.$", before):
            return before
    return text


def _type_name(node: Optional[ast.expr]) -> Optional[str]:
    if node is None:
        return None
    if isinstance(node, ast.Lambda):  # --attention-backend: AttnBackend[name]
        return "str"
    return ast.unparse(node)


def _action(node: Optional[ast.expr]) -> Optional[str]:
    if node is None:
        return None
    text = str(node.value) if isinstance(node, ast.Constant) else ast.unparse(node)
    return "BooleanOptionalAction" if text.endswith("BooleanOptionalAction") else text


def flag_record(call: ast.Call, group: str) -> dict:
    """One add_argument call as a JSON object."""
    names = [ast.literal_eval(a) for a in call.args]
    kw = {k.arg: k.value for k in call.keywords}
    action = _action(kw.get("action"))
    flag = next(n for n in names if n.startswith("--"))
    aliases = [n for n in names if n != flag]
    if action == "BooleanOptionalAction":
        aliases.append("--no-" + flag[2:])
    if "default" in kw:
        default = value(kw["default"])
    else:
        default = {"store_true": False, "store_false": True}.get(action or "")
    return {"flag": flag, "aliases": aliases,
            "dest": value(kw["dest"]) if "dest" in kw else flag[2:].replace("-", "_"),
            "default": default, "action": action, "type": _type_name(kw.get("type")),
            "nargs": value(kw.get("nargs")), "choices": value(kw.get("choices")),
            "group": group, "help": first_sentence(text_of(kw["help"])) if "help" in kw
            else ""}


def _groups(fn: ast.FunctionDef) -> dict[str, str]:
    """The function's group variables -> their titles (a mutually exclusive group has its
    parent's)."""
    titles: dict[str, str] = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        call = node.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
            continue
        if call.func.attr == "add_argument_group":
            kw = {k.arg: k.value for k in call.keywords}
            titles[_var(node.targets[0])] = ast.literal_eval(kw.get("title") or call.args[0])
        elif call.func.attr == "add_mutually_exclusive_group":
            titles[_var(node.targets[0])] = titles[_var(call.func.value)]
    return titles


def _var(node: ast.expr) -> str:
    """A variable's name (a parser or group: arguments.py assigns and calls no other)."""
    if not isinstance(node, ast.Name):
        raise ValueError(f"line {node.lineno}: expected a variable, got {ast.unparse(node)!r}")
    return node.id


def extract(source: str) -> list[dict]:
    """Every flag of arguments.py, in add_megatron_arguments' order."""
    tree = ast.parse(source)
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    called = sorted(((c.lineno, c.func.id) for c in ast.walk(functions["add_megatron_arguments"])
                     if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)),
                    key=lambda pair: pair[0])
    flags = []
    for _, name in called:
        fn = functions[name]
        titles = _groups(fn)
        adds = sorted(((c, c.func.value) for c in ast.walk(fn) if isinstance(c, ast.Call)
                       and isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"),
                      key=lambda pair: pair[0].lineno)
        flags += [flag_record(c, titles[_var(group)]) for c, group in adds]
    return flags


# ---------------------------------------------------------------- today's main: its parser

_ACTIONS = {"_StoreAction": None, "_StoreTrueAction": "store_true",
            "_StoreFalseAction": "store_false", "_StoreConstAction": "store_const",
            "_AppendAction": "append", "_AppendConstAction": "append_const",
            "_CountAction": "count", "BooleanOptionalAction": "BooleanOptionalAction"}


def jsonable(v: Any) -> Any:
    """A default or choice as JSON: an Enum member as its name (what the command line
    takes), a tuple as a list, a dtype or other object as its str()."""
    import enum
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def _type_of(action: Any) -> Optional[str]:
    t = action.type
    if t is None:
        return None
    if action.choices and all(hasattr(c, "name") and hasattr(c, "value")
                              for c in action.choices):
        return "str"  # an Enum's member, by name
    return t.__name__ if t.__name__ != "<lambda>" else "str"


def action_record(action: Any, group: str) -> dict:
    """One argparse action of Megatron-LM's parser as a JSON object."""
    names = list(action.option_strings)
    flag = next(n for n in names if n.startswith("--"))
    kind = type(action).__name__
    if kind not in _ACTIONS:
        raise ValueError(f"{flag}: action {kind} not known here")
    switch = _ACTIONS[kind] in ("store_true", "store_false", "store_const",
                                "BooleanOptionalAction")
    return {"flag": flag, "aliases": [n for n in names if n != flag], "dest": action.dest,
            "default": jsonable(action.default), "action": _ACTIONS[kind],
            "type": None if switch else _type_of(action),
            "nargs": None if switch else action.nargs,  # argparse's 0 for a switch
            "choices": jsonable(list(action.choices)) if action.choices is not None else None,
            "group": group, "help": first_sentence(action.help or "")}


def _stub_missing(packages: list[str]) -> None:
    """Packages Megatron-LM imports at module level for GPU kernels (triton): a stand-in
    module where they are not installed, so its argument code can be imported. torch's
    own optional imports of them are done first, so torch sees them missing."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    from unittest import mock

    import torch._inductor.compile_fx  # noqa: F401  (imports triton if it can)
    missing = [p for p in packages if importlib.util.find_spec(p) is None]

    class Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in missing:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            m = mock.MagicMock(name=spec.name)
            m.__spec__, m.__path__, m.__name__, m.__version__ = spec, [], spec.name, "0"
            return m

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Stub())


# Groups Megatron-LM adds only where an optional library imports (module -> the names its
# arguments.py imports from it): declared present, so the table has every flag.
OPTIONAL_GROUPS = {"megatron.core.extensions.kitchen": {"HAVE_KITCHEN": True,
                                                        "KitchenSpecProvider": object}}


def extract_from_checkout(checkout: str, stub: list[str]) -> list[dict]:
    """Every flag of Megatron-LM's parser at `checkout` (a directory holding megatron/),
    in its --help order."""
    import typing
    if not hasattr(typing, "override"):  # Python 3.12's, which it imports; a no-op
        typing.override = lambda f: f  # type: ignore[attr-defined]  # 3.12's, not in 3.11's
    _stub_missing(stub)
    sys.path.insert(0, os.path.abspath(checkout))
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]  # an installed megatron-core must not answer
    from megatron.training.arguments import add_megatron_arguments
    import types
    for name, attrs in OPTIONAL_GROUPS.items():
        stand_in = types.ModuleType(name)
        stand_in.__dict__.update(attrs)
        sys.modules[name] = stand_in
    assert os.path.abspath(sys.modules["megatron"].__path__[0]).startswith(
        os.path.abspath(checkout)), "megatron imported from elsewhere"
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    return [action_record(a, group_of[id(a)]) for a in parser._actions
            if a.option_strings and a.dest != "help"]


# ---------------------------------------------------------------- history


def gone_flags(previous: dict, flags: list[dict]) -> list[dict]:
    """The previous table's flags that `flags` no longer has (by option string), each
    with "last": the commit its table was read from (where it was last seen)."""
    names = {n for f in flags for n in (f["flag"], *f["aliases"])}
    commit = previous["source"].rsplit("@", 1)[1].strip()
    earlier = {f["flag"]: f for f in previous.get("gone", [])}
    gone = [{**f, "last": f.get("last", commit)} for f in previous["flags"]
            if not {f["flag"], *f["aliases"]} & names]
    return gone + [f for flag, f in earlier.items() if flag not in names
                   and flag not in {g["flag"] for g in gone}]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arguments_py", nargs="?",
                   help="a local copy of megatron/training/arguments.py (up to 000c4ac2)")
    p.add_argument("--source", help="a local checkout of Megatron-LM (today's main)")
    p.add_argument("--commit", required=True, help="the Megatron-LM commit it is from")
    p.add_argument("--previous", default=OUT,
                   help="the table this one replaces: its flags gone are kept (default: "
                        "the committed one)")
    p.add_argument("--stub", nargs="*", default=["triton"],
                   help="GPU-kernel packages to stand in for where not installed")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    if (args.arguments_py is None) == (args.source is None):
        p.error("give arguments.py or --source, one of them")
    if args.source:
        flags = extract_from_checkout(args.source, args.stub)
        where = "megatron/training/arguments.py (its parser, config dataclasses included)"
    else:
        with open(args.arguments_py) as f:
            flags = extract(f.read())
        where = "megatron/training/arguments.py"
    doc: dict[str, Any] = {"source": f"NVIDIA/Megatron-LM {where} @ {args.commit}",
                           "flags": flags}
    if args.previous and os.path.exists(args.previous):
        with open(args.previous) as f:
            previous = json.load(f)
        same = previous["source"] == doc["source"]  # regenerated: the history stays
        doc["previous"] = previous.get("previous") if same else previous["source"]
        doc["gone"] = gone_flags(previous, flags)
        old = {n for x in previous["flags"] for n in (x["flag"], *x["aliases"])}
        added = [x["flag"] for x in flags if not {x["flag"], *x["aliases"]} & old]
        print(f"since {previous['source'].rsplit('@', 1)[1].strip()[:8]}: {len(added)} flags "
              f"added; since {(doc['previous'] or '@ -').rsplit('@', 1)[1].strip()[:8]}: "
              f"{len(doc['gone'])} gone (kept in \"gone\")")
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"{len(flags)} flags -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
