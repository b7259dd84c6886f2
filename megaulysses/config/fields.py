"""How a schema field declares its flag: `option(default, help, ...)` puts a `Flag` in the
field's metadata, `derived()` marks a field that has no flag (resolve() fills it). The
command line (cli.py) is generated from this metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """One command-line flag of a field. `kind`: how the value is read and checked:
    "positive" (int > 0), "number" (finite float), "int", "gpu" (the planner's GPU table),
    "window" (--window-size: W, or Megatron-LM's L,R), None (a string). `action`: an argparse action name ("store_true", "optional" for
    --x/--no-x, "store_false", "store_const"); None: takes a value. `megatron`:
    Megatron-LM's name for it where it differs (None: the same name, or none there);
    `no_effect`: accepted for Megatron-LM's scripts but changes nothing here: why."""
    help: str
    names: tuple[str, ...] = ()  # () -> ("--" + the field name with dashes,)
    kind: Optional[str] = None
    choices: Optional[tuple] = None
    action: Optional[str] = None
    const: Any = None
    nargs: Optional[str | int] = None
    metavar: Optional[tuple[str, ...]] = None  # the names of an nargs flag's values, in --help
    default: Any = None  # for extra flags only: their own argparse default
    megatron: Optional[str] = None
    no_effect: str = ""
    dest: Optional[str] = None  # extra flags only: None sets the field, else this name


def option(default: Any, help: str, *, group: Optional[str] = None, before: tuple = (),
           after: tuple = (), **flag: Any) -> Any:
    """A field with its flag. `before`/`after`: extra `Flag`s listed around it in --help,
    which set the same field (or, with their own `dest`, a value the parser reads)."""
    meta = {"flags": (*before, Flag(help=help, **flag), *after), "main": len(before),
            "group": group}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def derived(default: Any = None) -> Any:
    """A field with no flag: filled from other flags, the world size or the tokenizer by
    resolve(), or while parsing."""
    return field(default=default, metadata={})


def filled(value: Optional[T], name: str) -> T:
    """`value` of a field that resolve() (or parsing) has filled, typed without its None;
    None means a caller skipped resolve(): a bug, named by the field `name`."""
    if value is None:
        raise AssertionError(f"{name} is None where parsing, the rules or resolve() give it a "
                             "value")
    return value
