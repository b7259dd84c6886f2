"""tools/check_layout.py on small synthetic packages written to tmp_path.

Each test writes a few real files under tmp_path/megaulysses/ and runs the tool on them,
in process through its functions (analyze, main) or as a script for the exit code.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "check_layout.py")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("check_layout_under_test", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def write(root, files):
    """files: {relative path: source}; package __init__.py files are added where missing."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for rel in files:
        parent = (root / rel).parent
        while parent != root and rel.startswith("megaulysses/"):
            init = parent / "__init__.py"
            if not init.exists():
                init.write_text("")
            parent = parent.parent
    return str(root)


def function(name, span, indent=""):
    """Source of a function whose def line to last line is `span` lines, decorated."""
    body = [f"{indent}    x{i} = {i}" for i in range(span - 2)]
    return "\n".join([f"{indent}@decorator", f"{indent}def {name}() -> None:",
                      f'{indent}    """Docstring, counted."""', *body]) + "\n"


CLEAN = {
    "megaulysses/config.py": "def parse(argv: list[str]) -> dict:\n    return {}\n",
    "megaulysses/data/indexed.py": "import os\n\n\ndef read(path: str) -> bytes:\n    return b''\n",
    "megaulysses/model/gpt.py": """\
        from megaulysses.config import parse
        from megaulysses.data import indexed


        class GPT:
            def __init__(self, n: int):
                self.n = n

            def forward(self, x: int) -> int:
                from megaulysses.model import layers  # lazy, same layer, no cycle
                return x
        """,
    "megaulysses/model/layers.py": "X = 1\n",
    "megaulysses/training/trainer.py": """\
        from ..model.gpt import GPT
        from megaulysses.parallel import dims


        def train(steps: int, *args: int, **kwargs: str) -> None:
            pass
        """,
    "megaulysses/parallel/dims.py": "from megaulysses.config import parse\n",
    "pretrain_gpt.py": "from megaulysses.training.trainer import train\n",
    "tools/plan.py": "import megaulysses.planner\n",
}


def test_clean_tree_passes(tool, tmp_path):
    report = tool.analyze(write(tmp_path, CLEAN))
    assert report.ok, tool.format_report(report, verbose=True)
    assert report.modules == 11  # 6 files + megaulysses/, data/, model/, training/, parallel/
    assert report.cycles == [] and report.upward == [] and report.unplaced == []
    assert (report.typed, report.public) == (5, 5)


def test_cycle_through_a_lazy_import_in_a_function(tool, tmp_path):
    root = write(tmp_path, {
        "megaulysses/model/a.py": """\
            X = 1


            def use():
                from . import b  # relative, lazy: still an edge
                return b.Y
            """,
        "megaulysses/model/b.py": "from megaulysses.model.a import X\nY = X\n",
        "megaulysses/model/c.py": "import megaulysses.model.a\n",  # into the cycle, not on it
    })
    report = tool.analyze(root)
    assert [c["modules"] for c in report.cycles] == [["megaulysses.model.a", "megaulysses.model.b"]]
    edges = {(e["src"], e["dst"], e["line"], e["lazy"]) for e in report.cycles[0]["imports"]}
    assert edges == {("megaulysses.model.a", "megaulysses.model.b", 5, True),
                     ("megaulysses.model.b", "megaulysses.model.a", 1, False)}
    assert not report.rules()["import_cycles"]


def test_type_checking_imports_are_left_out_of_the_graph(tool, tmp_path):
    root = write(tmp_path, {
        "megaulysses/model/a.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from megaulysses.model.b import Y
            """,
        "megaulysses/model/b.py": "from megaulysses.model.a import TYPE_CHECKING\nY = 1\n",
    })
    report = tool.analyze(root)
    assert report.cycles == []
    assert report.type_checking_imports == 1


def test_cycle_through_a_package_init_that_re_exports(tool, tmp_path):
    root = write(tmp_path, {
        "megaulysses/parallel/__init__.py": "from megaulysses.parallel.dims import TP\n",
        "megaulysses/parallel/dims.py": "TP = 'tp'\n\n\ndef f():\n    from megaulysses.parallel import SP\n",
        # a submodule named in `from package import name` is an edge to it, not to __init__
        "megaulysses/parallel/comm.py": "from megaulysses.parallel import dims\n",
    })
    report = tool.analyze(root)
    assert [c["modules"] for c in report.cycles] == [["megaulysses.parallel",
                                                      "megaulysses.parallel.dims"]]


def test_upward_imports_and_unplaced_modules(tool, tmp_path):
    root = write(tmp_path, {
        "megaulysses/config.py": "X = 1\n",
        "megaulysses/data/x.py": "import megaulysses.config\n",
        "megaulysses/data/y.py": "def f():\n    from megaulysses.hardware import gpus\n",
        "megaulysses/hardware/gpus.py": "from megaulysses.data import x\n",
        "megaulysses/model/gpt.py": "from megaulysses.data import x\n",  # downward: fine
        "megaulysses/errors.py": "class Error(Exception):\n    pass\n",
    })
    report = tool.analyze(root)
    found = {(u["src"], u["src_layer"], u["dst"], u["lazy"]) for u in report.upward}
    assert found == {
        ("megaulysses.data.x", "megaulysses.data", "megaulysses.config", False),
        ("megaulysses.data.y", "megaulysses.data", "megaulysses.hardware.gpus", True),
        ("megaulysses.hardware.gpus", "megaulysses.hardware", "megaulysses.data.x", False),
    }
    assert report.unplaced == ["megaulysses.errors"]
    assert not report.rules()["layering"]


def test_a_61_line_function_is_flagged_and_a_60_line_one_is_not(tool, tmp_path):
    nested = "class K:\n    def m(self) -> None:\n" + function("inner", 61, "        ")
    root = write(tmp_path, {"megaulysses/model/f.py": "decorator = None\n\n\n"
                            + function("sixty", 60) + function("sixty_one", 61) + nested})
    report = tool.analyze(root)
    spans = {f.name: f.lines for f in report.long_functions}
    assert spans == {"sixty_one": 61, "K.m.<locals>.inner": 61, "K.m": 63}
    assert report.longest.name == "K.m" and report.longest.lines == 63
    sixty = [f for f in tool.function_spans(tool.read_source(root, "megaulysses/model/f.py", True))
             if f.name == "sixty"]
    assert sixty[0].lines == 60


def test_typing_percentage_on_a_known_example(tool, tmp_path):
    root = write(tmp_path, {
        "megaulysses/model/typed.py": """\
            def a(x: int) -> int: ...                 # typed
            def b(x) -> int: ...                      # untyped: x
            def _c(x): ...                            # private: not counted
            class K:
                def __init__(self, x: int): ...       # typed: no return needed
                def m(self) -> None: ...              # typed
                def n(self, *args, y: int): ...       # untyped: *args, return
                @staticmethod
                def s(x: int) -> int: ...             # typed (x is no self)
                @staticmethod
                def t(self): ...                      # untyped: self, return
                def __repr__(self): ...               # dunder: not counted
                def _p(self): ...                     # private: not counted
                class Inner:
                    def deep(self): ...               # not a module-level class
            class _Hidden:
                def q(self): ...                      # private class: not counted
            if True:
                def d(**kw: int) -> None: ...         # typed, module level through an if
            """,
        "megaulysses/model/_impl.py": "def z(x): ...\n",  # private module: not counted
    })
    report = tool.analyze(root)
    assert (report.typed, report.public) == (5, 8)
    assert report.typed_percent == pytest.approx(62.5)
    assert {u.name: u.missing for u in report.untyped} == {
        "b": ["x"], "K.n": ["*args", "return"], "K.t": ["self", "return"]}
    assert not report.rules()["typing"]


def test_files_over_400_lines_at_most_two(tool, tmp_path):
    long = "x = 1\n" * 401
    files = {"megaulysses/model/a.py": long, "megaulysses/model/b.py": long,
             "megaulysses/model/c.py": "x = 1\n" * 400}
    assert tool.analyze(write(tmp_path, files)).rules()["file_length"]
    report = tool.analyze(write(tmp_path, {"megaulysses/model/d.py": long}))
    assert [f["path"] for f in report.long_files] == [
        "megaulysses/model/a.py", "megaulysses/model/b.py", "megaulysses/model/d.py"]
    assert not report.rules()["file_length"]


def test_exit_codes_and_json(tmp_path):
    clean = write(tmp_path / "clean", CLEAN)
    bad = write(tmp_path / "bad", {**CLEAN, "megaulysses/config.py":
                                   "def parse(argv: list[str]) -> dict:\n"
                                   "    from megaulysses.model import gpt\n"})
    ok = subprocess.run([sys.executable, TOOL, "--root", clean], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "all rules hold" in ok.stdout
    fail = subprocess.run([sys.executable, TOOL, "--root", bad, "--json"],
                          capture_output=True, text=True)
    assert fail.returncode == 1, fail.stdout + fail.stderr
    data = json.loads(fail.stdout)
    assert data["ok"] is False
    assert data["rules"]["import_cycles"] is False and data["rules"]["layering"] is False
    assert data["upward"][0]["src"] == "megaulysses.config"
    assert data["modules"] == 11
