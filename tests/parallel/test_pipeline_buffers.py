"""Pipeline receive buffers exist only while their micro-batch is in flight (issue 29,
item 1), and sent tensors only until their receiver has them (issue 40, item 3): the
live-bytes peak of a pp2 step with 64 micro-batches equals that with 8, for every
schedule, in training and in evaluation, within the size of the buffers in flight.

torch's PipelineStage alone allocates an activation and a gradient buffer per micro-batch
of the step and keeps them all: 112 buffers more at 64 micro-batches than at 8 on each
rank, which this test would see (measured before parallel/pipeline.py's `_Stage` bounded
them: +1,835,008 bytes a rank in a 1f1b step, +3,670,016 in evaluation; after: +0, and
+224 on the last stage, the schedule's 0-dim losses). torch's runtime schedule
(interleaved-1f1b, zero-bubble) also keeps every send's work, and the tensor sent, until
the step ends: +5,505,024 bytes a rank at 64 micro-batches in a training step (each
rank's two stages send 3 buffers a micro-batch), +3,670,016 on rank 0 in evaluation
(measured before parallel/pipeline_sends.py dropped each send once its receive was
posted; after: +0, and +224 on the last stage, as with 1f1b). Nothing is
subtracted for sends; what else grows with the micro-batch count is: the step's
micro-batches concatenated (`Pipeline._run`) and a 0-dim loss sum per micro-batch on the
last stage, a few bytes a token.

The model is tiny but wide (hidden 256, seq 32, micro-batch 1): a receive buffer, 4*T*h
= 32 KiB, dwarfs a micro-batch's 28 bytes a token. One spawn of 2 ranks runs every case.
"""

import gc
import logging

import torch

from dist import run_ranks
from helpers import LLAMA

PP2 = ["--pipeline-model-parallel-size", "2"]
BASE = LLAMA + PP2 + [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
    "--ffn-hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "1",
    "--train-iters", "2", "--lr-warmup-iters", "0", "--eval-iters", "0",
    "--log-interval", "100", "--generate", "0", "--peak-tflops", "1", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]
SCHEDULES = {"1f1b": ["--pipeline-schedule", "1f1b"],
             "gpipe-eval": ["--pipeline-schedule", "gpipe"],  # trains with all m in flight
             "interleaved-1f1b": ["--num-layers-per-virtual-pipeline-stage", "1"],
             "zero-bubble": ["--num-layers-per-virtual-pipeline-stage", "1",
                             "--pipeline-schedule", "zero-bubble"]}
FEW, MANY = 8, 64
BUFFER = 4 * 1 * 32 * 256  # one receive buffer: fp32 [b, s, h]
F32 = 4


def receive_buffers(pipe) -> list:
    """The receive buffers torch's stages hold between steps (none with ours)."""
    return [i.buffer for stage in pipe.stages
            for table in (stage.args_recv_info, stage.grad_recv_info)
            for infos in table.values() for i in infos]


def peaks(flags: list, m: int) -> tuple[int, int]:
    """(train step, evaluation) peaks of this rank over its second step with `m`
    micro-batches: the receive buffers held before it + the step's live-bytes peak, less
    the concatenated micro-batches and the per-micro-batch loss sums (nothing for the
    receive buffers or the tensors sent)."""
    import megaulysses.training.step as tr
    from megaulysses.config import parse_args
    from megaulysses.training.live_bytes import LiveBytes, storage_bytes
    from megaulysses.training.trainer import Trainer
    trainer = Trainer(parse_args(BASE + flags + ["--global-batch-size", str(m)]))
    t, pipe = trainer.cfg.train, trainer.pipeline

    def step(batches):
        tr.train_step(trainer.model, batches, trainer.zero, trainer.scaler, t.clip_grad,
                      trainer.device, trainer.dtype, trainer.comm, pipe)

    step(trainer.train_data.micro_batches(0))  # AdamW's states, the schedule's set-up
    batches = trainer.train_data.micro_batches(t.global_batch_size)
    growing = storage_bytes([v for b in batches for v in b.values()])
    growing += m * F32 if pipe.has_last else 0
    out = []
    for run in (step, torch.no_grad()(pipe.evaluate)):  # train, then evaluate, as step.py
        gc.collect()
        held = storage_bytes(receive_buffers(pipe))
        assert held == 0, held  # none between steps: they come with their micro-batch
        with LiveBytes() as mem:
            run(batches)
        out.append(held + mem.peak - growing)
    trainer = None  # step's closure cell too: the model is freed before the next run
    gc.collect()
    return out[0], out[1]


def measure_rank(rank, world) -> dict:
    logging.disable(logging.INFO)
    torch.manual_seed(0)
    return {(name, m): peaks(flags, m) for name, flags in SCHEDULES.items()
            for m in (FEW, MANY)}


def test_peak_does_not_grow_with_micro_batches():
    ranks = run_ranks(measure_rank, 2, timeout=900)
    for rank, per_case in enumerate(ranks):
        for name in SCHEDULES:
            (train_few, eval_few), (train_many, eval_many) = (per_case[(name, FEW)],
                                                              per_case[(name, MANY)])
            print(f"rank {rank} {name:<17} train {train_few} -> {train_many}  "
                  f"eval {eval_few} -> {eval_many} bytes ({FEW} -> {MANY} micro-batches)")
            # gpipe runs every forward before any backward, and waits for its forward
            # sends only then: rank 0 holds every micro-batch's output until all are sent
            # (as in training, where every micro-batch is in flight)
            sends = (MANY - FEW) * BUFFER if name == "gpipe-eval" and rank == 0 else 0
            assert abs(eval_many - eval_few) <= BUFFER + sends, (rank, name, eval_few,
                                                                 eval_many)
            if name != "gpipe-eval":
                assert abs(train_many - train_few) <= BUFFER, (rank, name, train_few,
                                                               train_many)
