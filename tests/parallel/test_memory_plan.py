"""The memory plan (planner/memory/) against what real ranks hold, and --dry-run.

Measured: per rank, the real Trainer on real gloo ranks runs one step (AdamW creates its
states), then the second step inside `LiveBytes`: the peak live tensor bytes of that step
plus what the rank held before it (parameters and buffers, optimizer states, its
micro-batches, and under pipeline parallelism any receive buffers held between steps:
none, parallel/pipeline.py allocates them while their micro-batch is in flight, inside
the step) -- benchmarks/fake_rank.py's split. Predicted: `plan_memory` from
the config alone. TOLERANCE: |predicted - measured| <= 10% of measured, on every rank of
every grid (issue 12, item 5). The communication bytes of the measured step (comm.stats)
must match the plan's `comm_by_group` per (group, kind): the planner (tools/plan.py)
times each group's bytes over its own link.

The models are small (2 layers, hidden 64, 4 heads, vocab 512) at seq 256 and micro-batch
2, so activations are most of the peak (the CPU block kernel's probabilities included);
one spawn per world size runs all of its grids. `-s` prints the table. Ulysses x Ring
(cp) and the masked block kernel (a sliding window, packed documents) are among them, in
fp32 and bf16, MHA and GQA, rings of 2 and 4; the ring's ranks are planned with their own
ring rank (the zigzag gives them different keys per step). Pipelines: 1f1b and
zero-bubble (whose ranks hold different counts of micro-batches, some between their
input- and weight-gradient passes).
"""

import gc
import logging

import pytest
import torch

from dist import run_ranks
from helpers import LLAMA, TINY, with_vocab

TOLERANCE = 0.10  # of the measured peak
MIB = 2 ** 20

BASE = LLAMA + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "256", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--lr-warmup-iters", "0", "--eval-iters", "0",
        "--log-interval", "100", "--generate", "0", "--peak-tflops", "1",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "511"]
SP2, TP2, PP2 = (["--ds-sequence-parallel-size", "2"], ["--tensor-model-parallel-size", "2"],
                 ["--pipeline-model-parallel-size", "2"])
CP2 = ["--context-parallel-size", "2"]
GQA2 = ["--group-query-attention", "--num-query-groups", "2"]
# Attention-bound: seq 512, a tiny MLP and vocabulary, so the peak is the attention core's
# backward (the block kernel's or the ring's working set is half of it), not the loss's.
CORE_BOUND = ["--seq-length", "512", "--ffn-hidden-size", "16", "--vocab-size", "100"]
FULL, SELECTIVE = ["--recompute-granularity", "full"], ["--recompute-activations"]
FPDT = ["--attention-dropout", "0", "--ds-sequence-parallel-fpdt",
        "--ds-sequence-parallel-fpdt-chunk-size"]  # + tokens
# Qwen3-like (issue 23): per-head q/k norms, q/k/v biases, head dim 24 != 64/4, YaRN
QWEN3 = GQA2 + ["--kv-channels", "24", "--qk-layernorm", "--add-qkv-bias", "--rope-type",
                "yarn", "--rotary-scaling-factor", "4"]
GRIDS = {  # world -> {name: flags}
    1: {"1 process, fp32, recompute none": [],
        "window 128 + documents, block kernel, core-bound": CORE_BOUND + [
            "--window-size", "128", "--reset-attention-mask", "--reset-position-ids"],
        "window 128, block kernel, GQA, bf16, core-bound": CORE_BOUND + GQA2 + [
            "--window-size", "128", "--bf16"],
        # attention dropout: the block kernel hashes its mask per query block (issue 39)
        "attention dropout 0.1, block kernel, core-bound": CORE_BOUND + [
            "--attention-dropout", "0.1"],
        "qk-layernorm + qkv biases, LayerNorm, fp32, none": QWEN3 + [
            "--normalization", "LayerNorm"]},
    2: {"sp2, ZeRO-0, none": SP2,
        "tp2 + Megatron-SP, qk-layernorm + qkv biases, bf16, none": TP2 + QWEN3 + [
            "--sequence-parallel", "--bf16"],
        "sp2, ZeRO-1, selective": SP2 + ["--zero-stage", "1"] + SELECTIVE,
        "sp2, ZeRO-3, full": SP2 + ["--zero-stage", "3"] + FULL,
        "sp2, ZeRO-3, full, attention head groups 2, core-bound": SP2 + [
            "--zero-stage", "3", "--attention-head-groups", "2"] + FULL + CORE_BOUND,
        "tp2 + Megatron-SP, selective, MLP tiled 2":
            TP2 + ["--sequence-parallel", "--tiled-mlp-chunks", "2"] + SELECTIVE,
        "tp2 + Megatron-SP, full, MLP tiled 2":
            TP2 + ["--sequence-parallel", "--tiled-mlp-chunks", "2"] + FULL,
        "pp2 1f1b, 4 micro-batches, none": PP2 + ["--global-batch-size", "8"],
        # torch's ZB1P: 2 stages a rank, a chunk kept from its input-gradient pass to its
        # weight-gradient pass (planner/memory/shapes.py's `pending`), 8 micro-batches
        "pp2 zero-bubble, 2 stages a rank, 8 micro-batches, none": PP2 + [
            "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
            "--pipeline-schedule", "zero-bubble", "--global-batch-size", "16"],
        "dp2, ZeRO-1, bf16, none": ["--zero-stage", "1", "--bf16"],
        "dp2, ZeRO-1, 4 buckets (--ddp-num-buckets), none": [
            "--zero-stage", "1", "--ddp-num-buckets", "4"],
        "dp2, distributed optimizer, offload 0.5, bf16 gradients, none": [
            "--use-distributed-optimizer", "--bf16", "--optimizer-cpu-offload",
            "--optimizer-offload-fraction", "0.5", "--grad-reduce-in-bf16"],
        "dp2, distributed optimizer, fp16 buffer (Megatron-LM's default), none": [
            "--use-distributed-optimizer", "--fp16", "--loss-scale", "64"],
        "tp2 + Megatron-SP, distributed optimizer, bf16 gradients, full": TP2 + [
            "--sequence-parallel", "--use-distributed-optimizer", "--grad-reduce-in-bf16",
            "--bf16"] + FULL,
        "cp2 (ring), ZeRO-3, none, core-bound": CP2 + CORE_BOUND + ["--zero-stage", "3"],
        "cp2 (ring), bf16, none, core-bound": CP2 + CORE_BOUND + ["--bf16"],
        "cp2 (ring), attention dropout 0.1, block steps, core-bound": CP2 + CORE_BOUND + [
            "--attention-dropout", "0.1"],
        # the residual stream in 16 bits (the default) and in fp32
        "pp2 1f1b, bf16, full, offload 1 layer, 4 micro-batches": PP2 + [
            "--global-batch-size", "8", "--bf16", "--cpu-offloading-num-layers", "1"] + FULL,
        "sp2, ZeRO-3, full, MLP tiled 2, bf16": SP2 + [
            "--zero-stage", "3", "--tiled-mlp-chunks", "2", "--bf16"] + FULL,
        "sp2, ZeRO-3, full, MLP tiled 2, bf16, fp32 residual": SP2 + [
            "--zero-stage", "3", "--tiled-mlp-chunks", "2", "--bf16",
            "--fp32-residual-connection"] + FULL,
        # chunked Ulysses attention (FPDT): the fused kernel's pairs, the block kernel's
        "sp2, FPDT 4 chunks, offloading, ZeRO-3, full, core-bound": SP2 + FPDT + [
            "128", "--ds-sequence-parallel-fpdt-offloading", "--zero-stage", "3"] + FULL
            + CORE_BOUND,
        "sp2, FPDT 2 chunks, window 128, none, core-bound": SP2 + FPDT + [
            "256", "--window-size", "128"] + CORE_BOUND},
    4: {"tp2 x sp2 + Megatron-SP, ZeRO-3, selective": TP2 + SP2 + [
            "--sequence-parallel", "--zero-stage", "3"] + SELECTIVE,
        "pp2 x sp2, ZeRO-1, full, 4 micro-batches": PP2 + SP2 + [
            "--zero-stage", "1", "--global-batch-size", "8"] + FULL,
        "sp2 x cp2 (Ulysses x ring), none": SP2 + CP2,
        "sp2 x cp2 (Ulysses x ring), full": SP2 + CP2 + FULL,
        "cp4 (ring), GQA, bf16, window 200, core-bound": [
            "--context-parallel-size", "4"] + CORE_BOUND + GQA2 + [
            "--seq-length", "1024", "--bf16", "--window-size", "200"]},
}


def measure_rank(rank, world, grids: dict) -> dict:
    """{grid: (measured peak bytes, plan's peak, measured comm bytes, plan's comm bytes)}
    of this rank, one Trainer per grid in turn (start-up logs silenced)."""
    before = logging.root.manager.disable
    logging.disable(logging.INFO)
    # The collections (two a grid, step_peak's and measure_grid's, and the automatic ones)
    # each walked the ~300k objects of torch's and the trainer's imports: half of a grid's
    # CPU time. Frozen, those are skipped; what the grids make is collected as before.
    gc.collect()
    gc.freeze()
    try:
        return {name: measure_grid(flags) for name, flags in grids.items()}
    finally:
        gc.unfreeze()
        logging.disable(before)


def measure_grid(flags: list) -> tuple:
    from megaulysses.config import parse_args
    from megaulysses.parallel.dims import CP, PP
    from megaulysses.planner.memory import plan_memory
    from megaulysses.training.live_bytes import step_peak
    from megaulysses.training.trainer import Trainer
    trainer = Trainer(parse_args(BASE + flags))
    measured, comm = step_peak(trainer)
    plan = plan_memory(trainer.cfg, trainer.dims, trainer.comm.rank(PP), "cpu",
                       cp_rank=trainer.comm.rank(CP))
    del trainer
    gc.collect()
    return measured, plan.peak_bytes, comm, plan.comm_by_group


@pytest.fixture(scope="module")
def measured():
    """{(world, rank, grid): (measured, predicted, comm measured, comm predicted)}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks run
    results = {}
    for world, grids in GRIDS.items():
        ranks = ([measure_rank(0, 1, grids)] if world == 1
                 else run_ranks(measure_rank, world, grids))
        for rank, per_grid in enumerate(ranks):
            for name, figures in per_grid.items():
                results[(world, rank, name)] = figures
    torch.set_num_threads(threads)
    print("\npredicted vs measured peak bytes per rank (MiB):")
    for (world, rank, name), (meas, pred, _, _) in results.items():
        print(f"  world {world} rank {rank}  {name:<46} predicted {pred / MIB:7.3f}  "
              f"measured {meas / MIB:7.3f}  error {100 * (pred - meas) / meas:+5.1f}%")
    return results


def test_plan_predicts_the_measured_peak(measured):
    assert len({key[2] for key in measured}) >= 12
    for (world, rank, name), (meas, pred, _, _) in measured.items():
        assert abs(pred - meas) <= TOLERANCE * meas, (world, rank, name, pred, meas)


def test_plan_predicts_the_communication_bytes(measured):
    for (world, rank, name), (_, _, comm, planned) in measured.items():
        for key in set(comm) | set(planned):  # (group, kind): the link the bytes cross
            got, want = comm.get(key, 0), planned.get(key, 0)  # (per-call rounding aside)
            assert abs(got - want) <= 1e-4 * want + 64, (world, rank, name, key, got, want)


def test_planner_predicts_the_measured_grids(measured):
    """tools/plan.py's validation (issue 14): the planner, given each measured grid as its
    own Grid (search.configure, not the trainer's config), predicts the largest peak of
    any rank within TOLERANCE, and the bytes per (group, kind) that the busiest pipeline
    stage's rank 0 sent, exactly."""
    from megaulysses.config import parse_args
    from megaulysses.training.data import load_tokenizer
    from megaulysses.hardware import gpu_spec
    from megaulysses.planner.search import Grid, evaluate
    checked = 0
    for world, grids in GRIDS.items():
        for name, flags in grids.items():
            cfg = parse_args(BASE + flags)
            cfg = with_vocab(cfg, load_tokenizer(cfg).vocab_size)
            par = cfg.parallel
            tp, pp, sp, cp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                              par.ds_sequence_parallel_size, par.context_parallel_size)
            dist_opt = par.use_distributed_optimizer
            grid = Grid(world // (tp * pp * sp * cp), tp, pp, sp, cp,
                        max(par.zero_stage, int(dist_opt)),
                        cfg.memory.recompute_granularity or "none",
                        cfg.memory.tiled_mlp_chunks, cfg.train.micro_batch_size,
                        par.tp_sequence_parallel, dist_opt,
                        head_groups=cfg.memory.attention_head_groups)
            c = evaluate(cfg, grid, gpu_spec("A100-80GB"), 0.0, device_type="cpu")
            assert c.kind == "fits", (name, c.reason)
            peak = max(meas for (w, _, n), (meas, *_) in measured.items()
                       if (w, n) == (world, name))
            assert abs(c.prediction.memory_bytes - peak) <= TOLERANCE * peak, (name, peak)
            stage = next(r for r in range(world) if measured[(world, r, name)][3]
                         == c.prediction.comm_bytes)  # the slowest stage's planned bytes
            sent = measured[(world, stage, name)][2]
            for key in set(sent) | set(c.prediction.comm_bytes):
                got, want = sent.get(key, 0), c.prediction.comm_bytes.get(key, 0)
                assert abs(got - want) <= 1e-4 * want + 64, (world, name, key, got, want)
            checked += 1
    assert checked >= 12


def test_selective_layer_terms_match_the_measured_starting_point():
    """One process, fp32, Llama style, MHA: a layer keeps T*(8h + 4f) + 2T fp32 elements
    under selective recomputation (measured, issue 12), and the micro-batch RoPE's cos and
    sin once, T*d (no longer gathered per layer)."""
    from megaulysses.config import parse_args, resolve
    from megaulysses.parallel.dims import ParallelDims
    from megaulysses.planner.memory import plan_memory
    cfg = resolve(parse_args(BASE + SELECTIVE), 1, 512)
    plan = plan_memory(cfg, ParallelDims(1, 1, 1, 1), 0, "cpu")
    m = cfg.model
    T, h, f, d = 2 * m.seq_length, m.hidden_size, m.ffn_size, m.head_dim
    assert plan.activation_bytes_per_layer == 4 * (T * (8 * h + 4 * f) + 2 * T)
    from megaulysses.planner.memory import _Activations, _RankLayout, _shape
    acts = _Activations(_shape(cfg, ParallelDims(1, 1, 1, 1), "cpu"), cfg,
                        _RankLayout.of(cfg, ParallelDims(1, 1, 1, 1), 0))
    assert acts.rotary == 4 * T * d


def test_trainer_logs_the_plan(caplog, tmp_path):
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    caplog.set_level(logging.INFO)
    Trainer(parse_args(TINY + ["--data-cache-path", str(tmp_path / "cache")]))
    assert "memory plan, pipeline rank 0" in caplog.text
    assert "peak (" in caplog.text


# -- --dry-run ---------------------------------------------------------------------------------

PAPER_30B = LLAMA + ["--num-layers", "64", "--hidden-size", "6144", "--num-attention-heads", "64",
             "--seq-length", "32768", "--max-position-embeddings", "32768",
             "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
             "--zero-stage", "3", "--ds-sequence-parallel-size", "8",
             "--recompute-granularity", "full", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "50257", "--mock-data", "--dry-run", "--dry-run-world-size", "64"]


class _AllocatedBytes:
    """LiveBytes that counts real allocations only (meta tensors describe shapes)."""

    def __new__(cls):
        from megaulysses.training.live_bytes import LiveBytes

        class NotMeta(LiveBytes):
            def _add(self, st):
                if st.device.type != "meta":
                    super()._add(st)

        return NotMeta()


def run_main(args, capfd) -> tuple[int, str, str]:
    import pretrain_gpt
    capfd.readouterr()
    rc = pretrain_gpt.main(list(args))
    out, err = capfd.readouterr()
    return rc, out, err


def test_dry_run_of_the_papers_30b_shape_allocates_nothing(capfd):
    with _AllocatedBytes() as mem:
        rc, out, err = run_main(PAPER_30B, capfd)
    assert rc == 0, err
    assert mem.peak < 16 * MIB, mem.peak
    assert "world 64 = dp 8 x tp 1 x pp 1 x sp 8" in out
    assert "memory plan, pipeline rank 0: 64 layers, ZeRO stage 3" in out
    for words in ("parameters", "gradients", "optimizer states", "activations", "peak (",
                  "all_to_all", "all_gather", "reduce_scatter"):
        assert words in out, out


USP_4096 = LLAMA + ["--dry-run", "--dry-run-world-size", "8", "--context-parallel-size", "4",
                    "--ds-sequence-parallel-size", "2", "--seq-length", "4096", "--mock-data"]


@pytest.mark.parametrize("flags,mask,core", [
    # plain causal: every ring step on the fused kernel (model/attention/fused.py)
    ([], "mask causal;", "ring over cp 4, fused kernel (with lse, one call a step)"),
    # ceil(511/64) + 1 = 9 blocks would reach back into another chunk (512 positions):
    # a ring step's keys of one rank within the window are 8 blocks
    (["--window-size", "512"], "mask causal + window 512;",
     "ring over cp 4, block kernel, blocks of 64, <= 512 keys"),
    (["--attention-sparsity", "bigbird"], "bigbird sparsity",  # 4 local, 1 global, 1 random
     "ring over cp 4, block kernel, blocks of 64, <= 384 keys"),
], ids=["causal", "window", "bigbird"])
def test_dry_run_of_ulysses_x_ring(capfd, flags, mask, core):
    """Ulysses 2 x ring 4 at seq 4096: 512 positions a rank, ZeRO's group dp*cp*sp, the
    ring's bytes, and the mask in the header and in the attention core's kernel."""
    rc, out, err = run_main(USP_4096 + flags, capfd)
    assert rc == 0, err
    assert "world 8 = dp 1 x tp 1 x pp 1 x sp 2 x cp 4;" in out
    assert "over dp*cp*sp = 8;" in out and "seq 4096 (512 tokens a rank)" in out
    assert mask in out, out
    assert core in out, out
    assert "micro-batches of 4096 tokens per rank" in out  # micro-batch 8 x 512 positions
    for words in ("all_to_all", "ring", "peak ("):
        assert words in out, out


def test_dry_run_gpu_says_the_plan_fits(capfd):
    rc, out, err = run_main(PAPER_30B + ["--dry-run-gpu", "a100-80gb"], capfd)
    assert rc == 0, err
    assert "fits A100-80GB: peak" in out and "of 76.0 GiB usable" in out


@pytest.mark.parametrize("gpu,rc", [("A100-40GB", 2), ("A100-80GB", 0)])
def test_dry_run_gpu_on_another_rank_exits_the_same_and_prints_nothing(
        capfd, monkeypatch, gpu, rc):
    """Under torchrun every rank runs --dry-run: a plan that does not fit exits 2 on every
    rank (rank 0 alone prints the line), one that fits exits 0 on every rank."""
    monkeypatch.setenv("RANK", "1")
    flags = PAPER_30B[:-2] + ["--dry-run-world-size", "8", "--dry-run-gpu", gpu]
    got, out, err = run_main(flags, capfd)
    assert got == rc
    assert out.strip() == "" and err.strip() == "", out + err


def test_dry_run_prints_every_pipeline_stage(capfd):
    rc, out, err = run_main(TINY + PP2 + ["--dry-run", "--dry-run-world-size", "2"], capfd)
    assert rc == 0, err
    assert "pipeline rank 0:" in out and "pipeline rank 1:" in out and "p2p" in out


@pytest.mark.parametrize("flags,flag", [
    (["--dry-run", "--dry-run-world-size", "6", "--ds-sequence-parallel-size", "4"],
     "--ds-sequence-parallel-size"),
    (["--dry-run", "--dry-run-world-size", "2", "--ds-sequence-parallel-size", "2",
      "--tiled-mlp-chunks", "3"], "--tiled-mlp-chunks"),
    (["--dry-run-world-size", "8"], "--dry-run-world-size"),
    (["--dry-run", "--dry-run-world-size", "8", "--tensor-model-parallel-size", "8"],
     "--tensor-model-parallel-size"),
    (["--dry-run", "--dry-run-gpu", "V100"], "--dry-run-gpu: unknown GPU 'V100'"),
    (["--dry-run-gpu", "H100"], "--dry-run-gpu: needs --dry-run"),
    (PAPER_30B[:-2] + ["--dry-run-world-size", "8", "--dry-run-gpu", "A100-40GB"],
     "--dry-run-gpu: pipeline rank 0 needs"),
], ids=["grid-vs-world", "tiles-vs-sequence", "world-without-dry-run", "heads-vs-tp",
        "unknown-gpu", "gpu-without-dry-run", "does-not-fit"])
def test_dry_run_bad_input_is_one_line_and_exit_2(capfd, flags, flag):
    rc, out, err = run_main((TINY if flags[0] != PAPER_30B[0] else []) + flags, capfd)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], err
    assert "Traceback" not in out + err
