"""Smoke test of benchmarks/attention_grid.py: a tiny run (4 gloo ranks, S=256, one warm-up
and one timed rep; part 2 at S=1024) into a temporary directory.

Checked: every configuration that can run did, with bytes by kind and pass equal to the
formulas (ratio exactly 1, integers) and max errors vs the single-process reference below
1e-4; Ulysses alone is n/a where the heads are fewer than its ranks (2 heads, U4); GQA with
kv heads below U (repeated before the exchange) is counted by max(hkv, U); part 2 has its
five rows with the computed fractions of the masks; the Markdown and JSON are written. No
time is asserted.
"""

import json
import os
import subprocess
import sys

from megaulysses.parallel.ring import ring_bytes_per_layer
from megaulysses.parallel.ulysses import ulysses_bytes_per_layer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "attention_grid.py")
P, S, D, SPARSE_S = 4, 256, 64, 1024
HEADS, KV = (4, 2), (1, 2)  # GQA, 1 kv head (repeated to U before the exchange); MHA, 2 heads


def test_tiny_run(tmp_path):
    cmd = [sys.executable, SCRIPT, "--ranks", str(P), "--seq", str(S),
           "--heads", *map(str, HEADS), "--kv-heads", *map(str, KV),
           "--warmup", "1", "--reps", "1", "--timeout", "120",
           "--sparse-seq", str(SPARSE_S), "--sparse-warmup", "0", "--sparse-reps", "1",
           "--window", "256", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "## Part 1" in text and "## Part 2" in text and "n/a: 2 heads < 4 ranks" in text

    res = json.loads((tmp_path / "attention_grid.json").read_text())
    assert (tmp_path / "attention_grid.md").read_text().startswith("# Ulysses x Ring")
    assert res["machine"]["cores"] >= 1 and res["machine"]["torch"]

    rows = res["part1"]["rows"]
    configs = {(r["U"], r["C"]) for r in rows}
    assert configs == {(4, 1), (1, 4), (2, 2)}
    ran = [r for r in rows if r["na"] is None]
    assert {(r["hq"], r["U"]) for r in rows if r["na"]} == {(2, 4)}
    assert len(ran) == len(rows) - 2  # U4 x two cores, for 2 heads
    for r in ran:
        hq, hkv, U, C = r["hq"], r["hkv"], r["U"], r["C"]
        a2a = ulysses_bytes_per_layer(1, S // C, hq, hkv, D, U, 4) if U > 1 else 0
        ring = ring_bytes_per_layer(1, S, max(hkv, U) // U, D, C, 4) if C > 1 else (0, 0)
        assert r["fwd"].get("all_to_all", 0) == a2a == r["bwd"].get("all_to_all", 0), r
        assert (r["fwd"].get("ring", 0), r["bwd"].get("ring", 0)) == ring, r
        assert r["bytes_match"] and r["bytes_ratio"] == 1.0 and r["bytes"] > 0, r
        assert r["bytes_equal_on_all_ranks"], r
        assert r["err_out"] < 1e-4 and r["err_grad"] < 1e-4, r
        assert r["time_s"] > 0 and 0 <= r["comm_share"] <= 1

    p2 = {(r["mask"].split()[0], r["kernel"]): r for r in res["part2"]["rows"]}
    assert set(p2) == {("dense", "block"), ("window", "block"), ("fixed", "block"),
                       ("bigbird", "block"), ("dense", "sdpa")}
    assert p2["dense", "block"]["fraction"] == 1.0 and p2["dense", "block"]["time_ratio"] == 1.0
    for name in ("window", "fixed", "bigbird"):
        assert 0 < p2[name, "block"]["fraction"] < 1, name
    assert res["part2"]["block_vs_sdpa"]["out"] < 1e-4
