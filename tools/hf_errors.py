"""The converter's error: bad input that main() prints as one line and exits 2 on."""

from __future__ import annotations

import sys


class ConvertError(Exception):
    """Bad input: main() prints "error: <where>: <rule>" as one line and exits 2."""

    def __init__(self, where: str, rule: str):
        super().__init__(f"{where}: {rule}")


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)
