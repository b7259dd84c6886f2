"""The commands the README and the guides show run as shown (issue 42, item 2).

Every ```bash block of README.md and docs/guides/*.md runs here from the repository root
under `bash -euo pipefail`, unless its first line is `# not run by the tests: <why>` (a
GPU, SLURM, a download, a long training). A renamed flag or a moved script then fails CI
instead of the reader. Blocks write under /tmp/megaulysses-guides/ only; each is meant to
take seconds (help, --dry-run, the planner, tiny conversions), at most two a guide.
"""

import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(glob.glob("docs/guides/*.md", root_dir=ROOT))]
SKIP = "# not run by the tests:"
MOST_RUN_A_GUIDE = 2  # the suite's time: each block starts Python and imports torch


def bash_blocks(path: str) -> list[tuple[int, str]]:
    """(first line, text) of each ```bash block of `path`."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    out, block, start = [], None, 0
    for i, line in enumerate(lines, 1):
        fence = re.match(r"\s*```(\w*)", line)
        if fence and block is None:
            block, start = ([] if fence.group(1) == "bash" else None), i
            if block is None:  # another language: skip to its end
                block = "other"
        elif fence:
            if block != "other":
                out.append((start, "\n".join(block)))
            block = None
        elif isinstance(block, list):
            block.append(line)
    return out


def runnable() -> list:
    return [pytest.param(doc, line, text, id=f"{doc}:{line}")
            for doc in DOCS for line, text in bash_blocks(doc)
            if not text.lstrip().startswith(SKIP)]


@pytest.mark.parametrize("doc,line,text", runnable())
def test_the_block_runs_as_shown(doc, line, text):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (f"{doc}:{line} exited {out.returncode}\n"
                                 f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


@pytest.mark.parametrize("doc", DOCS)
def test_a_guide_runs_few_blocks_and_says_why_the_others_are_not_run(doc):
    blocks = bash_blocks(doc)
    run = [line for line, text in blocks if not text.lstrip().startswith(SKIP)]
    assert len(run) <= MOST_RUN_A_GUIDE, f"{doc}: {len(run)} runnable blocks at lines {run}"
    for line, text in blocks:
        first = text.lstrip().splitlines()[0] if text.strip() else ""
        if first.startswith(SKIP):
            assert len(first) > len(SKIP) + 3, f"{doc}:{line}: say why it is not run"
