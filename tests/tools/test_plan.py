"""tools/plan.py: the search, the time model's arithmetic, and bad input (one line, exit 2).

The memory and the communication bytes the planner predicts are validated against real
gloo ranks in tests/parallel/test_memory_plan.py (test_planner_predicts_the_measured_grids);
here, in one process: what the search returns and rejects, which link each group's bytes
cross, and that the time parts add up.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import LLAMA, with_vocab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = os.path.join(ROOT, "tools", "plan.py")
# A small GPT-2-shaped model: fast to search, still big enough for memory to bind on 40 GB.
MODEL = LLAMA + ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16",
         "--seq-length", "131072", "--max-position-embeddings", "131072",
         "--global-batch-size", "4", "--vocab-size", "50257", "--bf16"]


def run_plan(args, tmp_path=None):
    out = subprocess.run([sys.executable, PLAN, *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    return out.returncode, out.stdout, out.stderr


def base_config(extra=()):
    from megaulysses.config import parse_args
    from megaulysses.training.data import load_tokenizer
    cfg = parse_args(MODEL + ["--tokenizer-type", "NullTokenizer", "--mock-data",
                              "--micro-batch-size", "1", *extra])
    return with_vocab(cfg, load_tokenizer(cfg).vocab_size)


def test_search_ranks_fitting_grids_fastest_first_and_says_why_others_fail():
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.search import search
    result = search(base_config(), 16, gpu_spec("A100-40GB"))
    times = [c.prediction.time_s for c in result.ranked]
    assert len(times) >= 5 and times == sorted(times)
    usable = result.ranked[0].prediction.usable_bytes
    assert all(c.prediction.memory_bytes <= usable for c in result.ranked)
    kinds = {c.kind for c in result.rejected}
    assert kinds == {"invalid", "memory"}
    assert all(c.prediction.memory_bytes > usable for c in result.rejected if c.kind == "memory")
    reasons = dict((k, n) for k, n, _ in result.reasons())
    assert "--global-batch-size" in reasons and "does not fit in memory" in reasons
    for c in result.faster_rejected():  # faster than the best, and too big
        assert c.prediction.time_s < times[0] and c.kind == "memory"
    assert result.dominated > 0


def test_fixed_flags_hold_the_grid():
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.search import search
    fixed = {"tp": 1, "pp": 1, "cp": 1, "zero": 3, "recompute": "full", "tiles": 1}
    result = search(base_config(), 16, gpu_spec("A100-80GB"), fixed)
    assert result.ranked
    for c in result.ranked + [c for c in result.rejected if c.kind == "memory"]:
        g = c.grid
        assert (g.tp, g.pp, g.cp, g.zero, g.recompute, g.tiles) == (1, 1, 1, 3, "full", 1)
    assert {c.grid.sp for c in result.ranked} <= {1, 2, 4, 8, 16}


def test_time_parts_add_up_and_links_follow_the_mesh():
    """Compute from hardware FLOPs at the table's efficiency; one node: every group on
    NVLink; 4 nodes: sp 8 stays in a node, dp x sp crosses InfiniBand."""
    from megaulysses.parallel.dims import ParallelDims
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.search import Grid, configure
    from megaulysses.planner.time_model import comm_seconds, link_of, predict
    gpu = gpu_spec("A100-80GB")
    cfg = configure(base_config(), Grid(4, 1, 1, 8, 1, 3, "full", 1, 1))
    dims = ParallelDims(dp=4, tp=1, pp=1, sp=8, cp=1)
    p = predict(cfg, dims, gpu)
    assert p.bubble_s == 0
    assert p.time_s == pytest.approx(p.compute_s + p.exposed_comm_s + p.optimizer_s)
    assert p.links == {"sp": "NVLink", "dp_sp": "NVLink+InfiniBand"}
    m = cfg.model
    tokens, h, S, q = m.seq_length / 8, m.hidden_size, m.seq_length, m.hidden_size
    gemm = 2 * (h * 4 * q + h * m.ffn_size * (3 if m.swiglu else 2))  # MHA
    attn = 2 * S * q
    layers = m.num_layers
    flops = tokens * (3 * layers * gemm + 3.5 * layers * attn + layers * (gemm + attn)
                      + 3 * 2 * h * m.padded_vocab_size)
    assert p.compute_s == pytest.approx(flops / (312e12 * 0.6), rel=1e-9)
    # all-to-all over 8 GPUs of one node: NVLink; over 16 of two nodes: half of it on IB
    assert comm_seconds(230e9, "sp", "all_to_all", dims, gpu) == pytest.approx(1.0)
    wide = ParallelDims(dp=2, tp=1, pp=1, sp=16, cp=1)
    assert link_of(wide, "sp", gpu) == "NVLink+InfiniBand"
    assert comm_seconds(15e9, "sp", "all_to_all", wide, gpu) == pytest.approx(
        max(7 / 15 * 15e9 / 230e9, 8 / 15 * 15e9 / 23e9))
    assert comm_seconds(23e9, "dp_sp", "reduce_scatter", dims, gpu) == pytest.approx(1.0)


def test_ring_attention_runs_at_the_ring_kernel_speed():
    import dataclasses
    from megaulysses.parallel.dims import ParallelDims
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.search import Grid, configure
    from megaulysses.planner.time_model import predict
    gpu = gpu_spec("H100")
    cfg = configure(base_config(), Grid(1, 1, 1, 4, 2, 3, "full", 1, 1))
    dims = ParallelDims(dp=1, tp=1, pp=1, sp=4, cp=2)
    slow = predict(cfg, dims, gpu)
    fast = predict(cfg, dims, dataclasses.replace(gpu, ring_kernel_speed=1.0))
    assert fast.compute_s < slow.compute_s < 2 * fast.compute_s


def test_head_groups_hide_the_all_to_all_behind_attention():
    """Ulysses' exchanges issued a group ahead (parallel/a2a_overlap.py): with G head
    groups (G-1)/G of them hide behind the attention, which here (128k positions) is far
    longer; the groups' recomputation exchanges show whole. Without groups nothing hides:
    every all-to-all second is exposed."""
    from megaulysses.parallel.dims import ParallelDims
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.memory import plan_memory
    from megaulysses.planner.search import Grid, configure
    from megaulysses.planner.time_model import predict
    gpu, dims = gpu_spec("H100"), ParallelDims(dp=1, tp=1, pp=1, sp=4, cp=1)
    exposed, hidden = {}, {}
    for G in (1, 2, 4):
        cfg = configure(base_config(), Grid(1, 1, 1, 4, 1, 3, "full", 1, 1, head_groups=G))
        p = predict(cfg, dims, gpu)
        a2a = p.comm_s[("sp", "all_to_all")]
        shown = sum(sec for (group, _), sec in p.comm_s.items() if group == "sp")
        exposed[G], hidden[G] = p.exposed_comm_s, shown - p.exposed_comm_s
        plan = plan_memory(cfg, dims, 0, "cuda")
        # MHA, 16 heads, sp 4: 4 kv heads a rank, grouped like q (each group's
        # recomputation sends its q, k and v again)
        hq = kv = 16
        again = hq + 2 * kv
        ahead = (2 * hq + 2 * kv) * (2 * plan.layers + plan.recomputed_layers)
        want = (G - 1) / G * a2a * ahead / (ahead + again * plan.layers) if G > 1 else 0.0
        assert hidden[G] == pytest.approx(want, rel=1e-9), G
    assert exposed[4] < exposed[2] < exposed[1]
    # FPDT in 8 chunks: q and out (dout and dq) a chunk ahead, half the bytes under MHA
    fpdt = ["--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size", "16384"]
    p = predict(configure(base_config(fpdt), Grid(1, 1, 1, 4, 1, 3, "full", 1, 1)), dims, gpu)
    shown = sum(sec for (group, _), sec in p.comm_s.items() if group == "sp")
    assert shown - p.exposed_comm_s == pytest.approx(7 / 8 * 0.5 * shown, rel=1e-9)


def test_cli_prints_the_top_grids_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    rc, stdout, stderr = run_plan(["--gpus", "16", "--gpu", "a100-40gb", "--top", "3",
                                   "--json", str(out), *MODEL])
    assert rc == 0, stderr
    assert "16 x A100-40GB" in stdout and "rejected:" in stdout
    data = json.loads(out.read_text())
    assert len(data["top"]) == 3
    assert data["top"][0]["time_s"] <= data["top"][1]["time_s"]
    assert "--tensor-model-parallel-size" in data["top"][0]["flags"]


def test_cli_one_grid_given_in_full(tmp_path):
    rc, stdout, _ = run_plan(["--gpus", "16", *MODEL, "--ds-sequence-parallel-size", "8",
                              "--tensor-model-parallel-size", "1",
                              "--pipeline-model-parallel-size", "1",
                              "--context-parallel-size", "1", "--zero-stage", "3",
                              "--recompute-granularity", "full", "--tiled-mlp-chunks", "1",
                              "--micro-batch-size", "1"])
    assert rc == 0
    assert "1 grids fit" in stdout
    assert "dp 2 x tp 1 x pp 1 x sp 8 x cp 1, ZeRO-3, recompute full" in stdout


@pytest.mark.parametrize("args, says", [
    (["--gpus", "16", "--gpu", "V100", *MODEL], "--gpu: unknown GPU 'V100'"),
    (["--gpus", "0", *MODEL], "--gpus: must be > 0"),
    (["--gpus", "16", "--efficiency", "1.5", *MODEL], "efficiency must be > 0 and <= 1"),
    (["--gpus", "16", *MODEL, "--ds-sequence-parallel-size", "3"],
     "no grid of 16 x A100-80GB is valid"),
    (["--gpus", "8", *MODEL, "--tensor-model-parallel-size", "1",
      "--pipeline-model-parallel-size", "1", "--ds-sequence-parallel-size", "32",
      "--context-parallel-size", "1", "--zero-stage", "3"],
     "tp*pp*sp*cp must divide 8"),
    (["--gpus", "32", *MODEL, "--tensor-model-parallel-size", "2",
      "--pipeline-model-parallel-size", "1", "--ds-sequence-parallel-size", "16",
      "--context-parallel-size", "1", "--zero-stage", "3", "--recompute-granularity", "full",
      "--tiled-mlp-chunks", "1", "--micro-batch-size", "1"],
     "the grid is not valid on 32 x A100-80GB: dp 1 x tp 2 x pp 1 x sp 16"),
    (["--gpus", "2", "--gpu", "A100-40GB", "--num-layers", "64", "--hidden-size", "8192",
      "--num-attention-heads", "64", "--seq-length", "1048576",
      "--max-position-embeddings", "1048576", "--global-batch-size", "1",
      "--vocab-size", "50257", "--bf16"], "the model fits on no grid of 2 x A100-40GB"),
    (["--gpus", "16", "--calibration", "/nonexistent.json", *MODEL], "--calibration"),
])
def test_bad_input_is_one_line_and_exit_2(args, says):
    rc, stdout, stderr = run_plan(args)
    assert rc == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], stderr
    assert "Traceback" not in stderr


def test_calibration_from_a_device_check_json(tmp_path):
    """The efficiency a measured 1-GPU step reached: the planner's compute time at
    efficiency 1 over the measured time (less the optimizer's)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from device_check import BIG, model_flags
    flags = model_flags(dict(BIG, seq=4096), 4096)
    path = tmp_path / "device_check.json"
    path.write_text(json.dumps({"parts": {"throughput": {
        "device": "NVIDIA H200", "step_s": 2.0, "flags": flags}}}))
    rc, stdout, stderr = run_plan(["--gpus", "8", "--gpu", "H200", "--calibration",
                                   str(path), *MODEL])
    assert rc == 0, stderr
    assert "calibration: NVIDIA H200" in stdout
    rc, _, stderr = run_plan(["--gpus", "8", "--gpu", "A100-80GB", "--calibration",
                              str(path), *MODEL])
    assert rc == 2 and "measured on NVIDIA H200, not A100-80GB" in stderr


def test_megatron_sp_is_searched_both_ways_and_shown():
    """Under tp > 1 the search tries Megatron-SP off and on and says which in the grid;
    --sequence-parallel among the flags holds it on."""
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.search import search
    fixed = {"tp": 2, "pp": 1, "cp": 1, "zero": 1, "tiles": 1}
    result = search(base_config(), 8, gpu_spec("A100-80GB"), fixed)
    seen = {c.grid.megatron_sp for c in result.ranked + result.rejected if c.grid.tp == 2}
    assert seen == {False, True}
    for c in result.ranked:
        on = c.grid.megatron_sp
        assert ("Megatron-SP" in str(c.grid)) == on
        assert ("--sequence-parallel" in c.grid.flags()) == on
    held = search(base_config(), 8, gpu_spec("A100-80GB"), {**fixed, "megatron_sp": True})
    assert held.ranked and all(c.grid.megatron_sp for c in held.ranked)


# Grids given in full: the plan's GiB/GPU and --dry-run's peak for the same flags.
AGREE = {"tp2, Megatron-SP, fp16": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--fp16", "--ds-sequence-parallel-size", "4"],
         "tp2 without SP": ["--tensor-model-parallel-size", "2",
                            "--ds-sequence-parallel-size", "4"],
         "pp2 x sp2, ZeRO-3": ["--pipeline-model-parallel-size", "2",
                               "--ds-sequence-parallel-size", "2", "--zero-stage", "3"],
         "dp8, distributed optimizer, bf16 gradients": ["--global-batch-size", "8",
                                                        "--use-distributed-optimizer",
                                                        "--grad-reduce-in-bf16"]}


@pytest.mark.parametrize("name", sorted(AGREE))
def test_plan_and_dry_run_agree(name):
    import re
    import pretrain_gpt
    from helpers import load_tool, run_main
    grid = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--ds-sequence-parallel-size", "1", "--context-parallel-size", "1",
            "--zero-stage", "1", "--recompute-granularity", "full", "--tiled-mlp-chunks", "1",
            "--micro-batch-size", "1"]
    flags = [f for f in MODEL if f != "--bf16"] + grid + AGREE[name]  # later flags win
    if "--fp16" not in flags:
        flags.append("--bf16")
    rc, out, err = run_main(load_tool("plan"), "--gpus", "8", "--gpu", "H100", *flags)
    assert rc == 0, err
    assert ("fp16" if "--fp16" in flags else "bf16") in out.splitlines()[0]
    row = next(line for line in out.splitlines() if line.startswith("1  "))
    assert ("Megatron-SP" in row) == ("--sequence-parallel" in flags)
    planned = float(row.split("micro-batch 1")[1].split()[0])
    # --zero-stage 1 is searched with and without the distributed optimizer (the row says)
    dist_opt = ["--use-distributed-optimizer"] if "distributed optimizer" in row else []
    assert dist_opt or "--use-distributed-optimizer" not in flags
    rc, out, err = run_main(pretrain_gpt, *flags, *dist_opt, "--vocab-size", "50257",
                            "--tokenizer-type",
                            "NullTokenizer", "--mock-data", "--dry-run",
                            "--dry-run-world-size", "8", "--dry-run-gpu", "H100")
    assert rc == 0, err
    assert float(re.search(r"fits H100: peak ([\d.]+) GiB", out).group(1)) == planned


def test_search_puts_the_parameters_on_the_host_last_and_on_one_gpu():
    """ZeRO-3 with the shards on the host (--zero-param-offload) is the ladder's last rung,
    after ZeRO-3, and on one GPU alone the only ZeRO there; it is what fits four
    micro-batches of 128K tokens on one A100-40GB with the MLP in 4 tiles (ZeRO-0 needs 16).
    FPDT's sequence chunks are tried after the head groups. Beside tp ranks (dp x cp x sp
    = 1) the host rung is not tried."""
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.search import configure, search
    base = base_config()
    result = search(base, 1, gpu_spec("A100-40GB"), {"micro_batch": 4})
    host = [c.grid for c in result.ranked if c.grid.param_offload]
    assert [(g.zero, g.tiles) for g in host] == [(3, 4)], result.ranked
    grid = host[0]
    assert "ZeRO-3, params on host" in str(grid) and "--zero-param-offload" in grid.flags()
    assert configure(base, grid).parallel.zero_param_offload
    tried = result.ranked + result.rejected
    assert {(c.grid.zero, c.grid.param_offload) for c in tried} == {(0, False), (3, True)}
    # 1M tokens fit nowhere: every level is walked, FPDT's last
    long = ["--seq-length", str(2 ** 20), "--max-position-embeddings", str(2 ** 20)]
    walked = search(base_config(long), 1, gpu_spec("A100-40GB"), {"micro_batch": 1})
    fpdt = [c.grid for c in walked.rejected if c.grid.fpdt]
    assert [c.grid.fpdt for c in walked.rejected][-2:] == [16384, 16384]
    assert {g.fpdt for g in fpdt} == {65536, 16384} and all(g.head_groups == 1 for g in fpdt)
    assert "--ds-sequence-parallel-fpdt-chunk-size" in fpdt[0].flags()
    tp2 = search(base, 2, gpu_spec("A100-40GB"), {"tp": 2, "micro_batch": 4})
    assert not any(c.grid.param_offload for c in tp2.ranked + tp2.rejected)
    # asked for in the flags: held
    held = search(base_config(["--zero-stage", "3", "--zero-param-offload"]), 2,
                  gpu_spec("A100-40GB"), {"zero": 3, "micro_batch": 4})
    assert all(c.grid.param_offload for c in held.ranked + held.rejected)


def test_search_offloads_as_many_layers_as_the_host_holds():
    """Where every layer's input on the host outgrows the host's share, the search keeps the
    rest on the device: the most layers the host holds (a bisection over the count). 512K
    tokens on one A100-40GB machine with 22 GiB of host memory: 5 of 8 layers."""
    from dataclasses import replace

    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.search import evaluate, search
    base = base_config(["--seq-length", str(2 ** 19), "--max-position-embeddings", str(2 ** 19)])
    gpu = gpu_spec("A100-40GB", gpus_per_node=1, host_memory_gib=22)
    best = search(base, 1, gpu, {"micro_batch": 1}).ranked[0]
    assert 0 < best.grid.offload < 8 and best.grid.param_offload, best.grid
    assert f"activations offloaded ({best.grid.offload} layers a stage)" in str(best.grid)
    more = evaluate(base, replace(best.grid, offload=best.grid.offload + 1), gpu, 4.0)
    assert more.kind == "memory" and not more.prediction.fits_host
    fewer = evaluate(base, replace(best.grid, offload=best.grid.offload - 1), gpu, 4.0)
    assert fewer.prediction.memory_bytes > best.prediction.memory_bytes
    # asked for in the flags: the count is held, not searched
    held = search(base, 1, gpu, {"micro_batch": 1, "offload": 2})
    assert {c.grid.offload for c in held.ranked + held.rejected} <= {0, 2}


def test_a_job_on_part_of_a_node_has_the_nodes_host_memory():
    """The host's share is the node's memory over the job's ranks on it: one GPU of an
    8-GPU node has all of it (an exclusive allocation); a one-GPU machine is a node of one."""
    from megaulysses.config import resolve
    from megaulysses.hardware import gpu_spec, host_share_gib
    from megaulysses.planner.time_model import predict
    h100 = gpu_spec("H100")
    assert host_share_gib(h100, 1) == 8 * host_share_gib(h100, 8) == 8 * h100.host_memory_gib
    assert host_share_gib(h100, 4) == 2 * h100.host_memory_gib
    assert host_share_gib(h100, 64) == h100.host_memory_gib
    assert host_share_gib(gpu_spec("H100", gpus_per_node=1), 1) == h100.host_memory_gib
    cfg = resolve(base_config(), 1, 50257)
    alone, shared = (predict(cfg, cfg.dims, g) for g in (h100, gpu_spec("H100", gpus_per_node=1)))
    assert alone.host_usable_bytes == 8 * shared.host_usable_bytes


def test_a_grid_fits_with_a_margin_for_the_kernels_unmeasured_buffers():
    """The fused attention backward's own buffers (cores.py `core_scratch`) are planned but
    no rank measures them: a grid fits only with UNMEASURED_MARGIN of them free beyond the
    plan, and the refusal says so. CPU plans have none."""
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.memory import plan_memory
    from megaulysses.planner.search import Grid, configure, evaluate
    from megaulysses.planner.time_model import UNMEASURED_MARGIN, predict
    base = base_config()
    grid = Grid(1, 1, 1, 1, 1, 0, "full", 4, 1)
    cfg = configure(base, grid)
    plan = plan_memory(cfg, cfg.dims, 0, "cuda")
    assert plan.unmeasured_bytes > 0 and plan_memory(cfg, cfg.dims, 0, "cpu").unmeasured_bytes == 0
    p = predict(cfg, cfg.dims, gpu_spec("H100"))
    assert p.margin_bytes == int(UNMEASURED_MARGIN * plan.unmeasured_bytes)
    # a GPU whose usable memory sits between the plan and the plan with its margin
    gib = (p.memory_bytes + p.margin_bytes // 2) / 2 ** 30 + 4.0
    c = evaluate(base, grid, gpu_spec("H100", memory_gib=gib), 4.0)
    assert c.kind == "memory" and "margin" in c.reason, c.reason
    assert evaluate(base, grid, gpu_spec("H100", memory_gib=gib + 1), 4.0).kind == "fits"
