"""Megatron-LM's flags as data: megaulysses/config/megatron_args.json, read from a local
copy of its megatron/training/arguments.py with `ast` (nothing of Megatron-LM is imported
or run, nothing is downloaded).

    python tools/megatron_args.py PATH/TO/arguments.py --commit SHA

One object per `add_argument` call, in the order Megatron-LM's --help lists them (its
`add_megatron_arguments` calls the `_add_*_args` functions in that order): the flag, its
aliases (its other option strings; --no-X for a BooleanOptionalAction), dest, default,
action, type, nargs, choices, its argparse group's title and the first sentence of its
help. The JSON is committed; megaulysses/config/megatron.py reads it at run time.

It reads versions whose flags are all literal `add_argument` calls (up to commit 000c4ac2,
the one committed); newer ones generate many flags from dataclasses, which this does not
follow.
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
        return int(value(node.args[0].args[1]))
    raise ValueError(f"line {node.lineno}: cannot read {text!r} as a value")


def text_of(node: ast.expr) -> str:
    """A help expression as text: string literals, their concatenation, f-strings (their
    fields as written), %-formatting and .format left as written."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return text_of(node.left) + text_of(node.right)
    if isinstance(node, ast.JoinedStr):
        return "".join(text_of(v) if isinstance(v, ast.Constant) else
                       "{" + ast.unparse(v.value) + "}" for v in node.values)
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
    text = ast.unparse(node) if not isinstance(node, ast.Constant) else node.value
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
        default = {"store_true": False, "store_false": True}.get(action)
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
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)):
            continue
        call, name = node.value, node.targets[0].id
        if call.func.attr == "add_argument_group":
            kw = {k.arg: k.value for k in call.keywords}
            titles[name] = ast.literal_eval(kw.get("title") or call.args[0])
        elif call.func.attr == "add_mutually_exclusive_group":
            titles[name] = titles[call.func.value.id]
    return titles


def extract(source: str) -> list[dict]:
    """Every flag of arguments.py, in add_megatron_arguments' order."""
    tree = ast.parse(source)
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    calls = sorted((c for c in ast.walk(functions["add_megatron_arguments"])
                    if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)),
                   key=lambda c: c.lineno)
    flags = []
    for name in (c.func.id for c in calls):
        fn = functions[name]
        titles = _groups(fn)
        calls = sorted((c for c in ast.walk(fn) if isinstance(c, ast.Call)
                        and isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"),
                       key=lambda c: c.lineno)
        flags += [flag_record(c, titles[c.func.value.id]) for c in calls]
    return flags


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arguments_py", help="a local copy of megatron/training/arguments.py")
    p.add_argument("--commit", required=True, help="the Megatron-LM commit it is from")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    with open(args.arguments_py) as f:
        flags = extract(f.read())
    doc = {"source": f"NVIDIA/Megatron-LM megatron/training/arguments.py @ {args.commit}",
           "flags": flags}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"{len(flags)} flags -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
