"""The package's layout holds (issue 26): no function over 60 lines, no import cycle (lazy
imports included), no upward import between layers, public functions fully typed (>= 90%),
at most 2 files over 400 lines. tools/check_layout.py says which rule breaks and where."""

import subprocess
import sys

from helpers import REPO


def test_layout_rules_hold():
    proc = subprocess.run([sys.executable, "tools/check_layout.py", "--verbose"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all rules hold" in proc.stdout
