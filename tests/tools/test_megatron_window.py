"""A Megatron-LM model with a sliding window keeps it, both ways (issue 39, part 7).

Megatron-LM's --window-size is a pair (left, right): query i attends keys i-left..i+right
(its local softmax's get_sliding_window_causal_mask); ours is W, the last W keys, i itself
included: (L, 0) is W = L+1. A megatron-core GPT with window (3, 0) is saved; the import
has --window-size 4 and the same logits (fp32, 1e-5: the bound of the checkpoint tests),
which a full causal model would not have; training from it without --window-size stops
(exit 2, naming it); to-megatron writes the pair back. Megatron-LM's spelling is accepted
on our command line too.
"""

import dataclasses
import os
import shlex
import subprocess
import sys

import pytest
import torch

from dist import run_ranks
from helpers import REPO, load_tool, run_main

pytest.importorskip("megatron.core", reason="megatron-core is the oracle")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

WINDOW, LOGITS_ATOL = (3, 0), 1e-5
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))


def megatron_windowed(rank, world, out_dir):
    import megatron_oracle as mo
    mo.init_megatron(rank, world, 1, 1)
    with mo.cuda_on_cpu():
        model = mo.build_model("gpt", window_size=WINDOW)
        logits = mo.forward_logits(model, TOKENS)  # [b, s, v]
        mo.save_legacy_torch(model, out_dir, 1, mo.megatron_args("gpt", window_size=WINDOW))
    mo.destroy_megatron()
    return logits.numpy()  # numpy: a tensor would travel by shared memory the rank takes along


def test_a_megatron_window_comes_back_both_ways(tmp_path):
    from megaulysses.model.attention import math_attention
    from megaulysses.model.gpt import build_model
    from megaulysses.training.megatron import read_megatron
    theirs = torch.from_numpy(run_ranks(megatron_windowed, 1, str(tmp_path / "meg"),
                                        daemon=False)[0])
    ckpt = read_megatron(str(tmp_path / "meg"))
    assert ckpt.cfg.window_size == WINDOW[0] + 1
    diffs = {}
    for window in (ckpt.cfg.window_size, None):
        model = build_model(dataclasses.replace(ckpt.cfg, window_size=window), math_attention,
                            seed=0)
        model.load_state_dict(ckpt.state)
        with torch.no_grad():
            diffs[window] = float((model.eval()(TOKENS) - theirs).abs().max())
    assert diffs[WINDOW[0] + 1] <= LOGITS_ATOL < diffs[None], diffs

    convert = load_tool("convert_checkpoint")
    rc, out, err = run_main(convert, "from-megatron", "--load", str(tmp_path / "meg"),
                            "--save", str(tmp_path / "ours"))
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("python pretrain_gpt.py"))
    printed = shlex.split(line)[2:]
    at = printed.index("--window-size")
    assert printed[at + 1] == "4"  # the printed flags carry it
    run = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
           "--train-iters", "2", "--micro-batch-size", "1",
           "--global-batch-size", "1", "--eval-iters", "0", "--save", str(tmp_path / "run"),
           "--save-interval", "1"]
    without = printed[:at] + printed[at + 2:] + run
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *without],
                          capture_output=True, text=True, timeout=300)
    # training it as full causal would train another function: one line, exit 2
    assert proc.returncode == 2 and "--window-size" in proc.stderr, proc.stderr[-2000:]
    import pretrain_gpt
    megatron_spelling = printed[:at] + ["--window-size", "3,0"] + printed[at + 2:]
    assert pretrain_gpt.main(megatron_spelling + run) == 0
    rc, out, err = run_main(convert, "to-megatron", "--load", str(tmp_path / "run"),
                            "--save", str(tmp_path / "back"), "--ckpt-format", "torch")
    assert rc == 0, err
    back = read_megatron(str(tmp_path / "back"))
    assert tuple(back.common["args"].window_size) == WINDOW and back.cfg.window_size == 4
