"""docs/guides/checkpoints.md's "Extend a model's context" walk-through, run as written: a tiny model saved
by transformers -> from-hf -> 4x the context with Ulysses x ring and a raised RoPE base on
4 processes -> to-hf -> transformers loads it and generates. Then the at-scale recipe's
flags for Llama-3.1-8B at 128K pass the trainer's checks for 8 ranks (--dry-run)."""

import json
import os
import re
import shlex
import subprocess

from helpers import REPO

SECTION = "## Extend a model's context"


def readme_blocks() -> list[str]:
    with open(os.path.join(REPO, "docs", "guides", "checkpoints.md")) as f:
        text = f.read()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def test_the_walk_through_runs_as_written(tmp_path):
    # The commands use paths relative to the checkout; outputs go under runs/extend, so
    # they run in a scratch directory that links the checkout's files.
    for name in ("pretrain_gpt.py", "tools", "examples", "data"):
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", readme_blocks()[0]],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "context extension: runs/extend/base/iter_0000000 was saved with --seq-length 128" \
        in run.stderr + run.stdout
    config = json.loads((tmp_path / "runs/extend/hf_long/config.json").read_text())
    assert config["max_position_embeddings"] == 512 and config["dtype"] == "bfloat16"
    rope = config["rope_parameters"]
    assert rope["rope_theta"] == 2000000.0 and rope["rope_type"] == "llama3"
    assert rope["original_max_position_embeddings"] == 64 and rope["factor"] == 8.0
    assert "LlamaForCausalLM (torch.bfloat16): max_position_embeddings 512" in run.stdout
    assert run.stdout.rstrip().splitlines()[-1].startswith("'ROMEO:")  # the generated text


def test_the_llama_8b_recipe_fits_its_grid():
    """The at-scale command's flags, with --dry-run for its 8 ranks: every rule holds."""
    block = readme_blocks()[1]
    model = shlex.split(re.search(r'LLAMA31_8B="(.*?)"', block, re.S).group(1))
    command = block[block.index("torchrun"):].split("\npython tools/convert")[0]
    flags = shlex.split(command.replace("\\\n", " "))
    flags = flags[flags.index("pretrain_gpt.py") + 1:]
    flags = [f for f in flags if f != "$LLAMA31_8B"]
    skip = {"--load", "--tokenizer-type", "--tokenizer-model", "--data-path", "--save"}
    kept = []
    for i, f in enumerate(flags):
        if f in skip or (i and flags[i - 1] in skip):
            continue
        kept.append(f)
    run = subprocess.run(
        ["python", os.path.join(REPO, "pretrain_gpt.py"), *model, *kept, "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128255", "--dry-run",
         "--dry-run-world-size", "8", "--dry-run-gpu", "H100"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "dp 4 x tp 1 x pp 1 x sp 2" in out.replace("grid: world 8 = ", ""), out[-2000:]
