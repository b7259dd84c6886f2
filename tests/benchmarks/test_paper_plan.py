"""benchmarks/paper_plan.py, smoke: a script's configurations come back with the GPT-2
vocabulary, and one search of the comparison finds a grid that fits (the whole script
takes ~1 min; docs/paper_plan.md is its output)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_script_configs_and_one_comparison():
    import paper_plan
    from megaulysses.hardware import gpu_spec
    configs = paper_plan.script_configs("fig8_convergence_1p3b.sh")
    assert [gpus for _, gpus, _ in configs] == [8, 8, 8, 8]
    for name, _, flags in configs:
        assert "--data-path" not in flags and flags[-5:] == paper_plan.VOCAB, name
    fixed = dict(paper_plan.ULYSSES, recompute="full", tiles=1, micro_batch=1)
    r = paper_plan.best("1.2B", 8, 32768, fixed, gpu_spec("A100-80GB"))
    assert r["fits"] and "ZeRO-3" in r["grid"] and "tp 1" in r["grid"]
    assert 0 < r["mfu"] < 1.5 and r["memory_gib"] < 76
