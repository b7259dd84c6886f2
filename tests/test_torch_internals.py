"""The torch range told truthfully (issue 42, item 6): every private part of torch the
code uses is listed in megaulysses/torch_internals.py, present in the torch CI tests, and
a missing one stops a run at start-up in one line naming the torch version and the part.
"""

import os
import re
import subprocess
import sys

from helpers import TINY

from megaulysses import torch_internals as ti

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch.<...>._private chains and `from torch... import _private` in the package's code
CHAIN = re.compile(r"torch(?:\.\w+)*\._\w+(?:\.\w+)*")
IMPORT = re.compile(r"from (torch[\w.]*) import \(?([^)\n]+)")


def _used() -> set[str]:
    found = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "megaulysses")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or name == "torch_internals.py":
                continue
            text = open(path, encoding="utf-8").read()
            found |= {c for c in CHAIN.findall(text) if c != "torch.__version__"}
            for module, names in IMPORT.findall(text):
                for n in (n.split(" as ")[0].strip() for n in names.split(",")):
                    if n and ("._" in module or n.startswith("_")):
                        found.add(f"{module}.{n}")
    return found


def test_every_private_part_in_use_is_listed():
    listed = [i.name.replace(":", ".") for i in ti.INTERNALS]
    missing = sorted(u for u in _used()
                     if not any(x.startswith(u) or u.startswith(x) for x in listed))
    assert not missing, f"not in megaulysses/torch_internals.py: {missing}"


def test_the_tested_torch_has_every_part():
    assert [(i.name, ti.problem(i)) for i in ti.INTERNALS if ti.problem(i)] == []
    import torch
    assert torch.__version__.startswith(ti.TESTED)
    ti.check()


def test_a_missing_part_stops_the_run_in_one_line_before_any_step(tmp_path):
    """A torch whose pipelining lost a hook: pretrain_gpt.py names it and exits 2."""
    shim = tmp_path / "sitecustomize.py"
    shim.write_text("from torch.distributed.pipelining import PipelineStage\n"
                    "name = '_create_grad_recv_info'\n"
                    "for c in PipelineStage.__mro__:\n"
                    "    if name in vars(c):\n"
                    "        delattr(c, name)\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{ROOT}")
    out = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY,
                          "--save", str(tmp_path / "ckpt")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: torch 2.13") and "_create_grad_recv_info" in line, line
    assert "used by parallel/pipeline.py" in line and "tested with torch 2.13" in line
    assert not (tmp_path / "ckpt").exists()


def test_a_changed_signature_is_named():
    item = ti.Internal("torch.distributed.pipelining:PipelineStage.get_fwd_recv_ops",
                       "parallel/pipeline.py", ("fwd_chunk_id", "a_new_argument"))
    assert ti.problem(item) == "changed: no parameter a_new_argument"
