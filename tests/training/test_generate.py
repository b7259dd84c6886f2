"""Sampling after training (`Trainer.generate`) runs in the compute dtype through a core
valid for it, and on a grid never builds a second whole model on the training device.

The flash backend refuses fp32; before the fix, a --bf16 run sampled from the fp32 model
without autocast and crashed there on CUDA. Here every attention core is swapped for one
that refuses fp32 inputs just as flash does, so the same mistake fails on CPU.
"""

import torch

from dist import run_ranks
from helpers import TINY

ARGS = TINY + ["--train-iters", "2", "--eval-iters", "0", "--mock-data", "--tokenizer-type",
               "NullTokenizer", "--vocab-size", "512", "--generate", "4", "--bf16"]


def sixteen_bit_only(core, seen: list):
    """`core`, refusing fp32 q/k/v as flash-attn does; records the dtypes it ran in."""
    def run(q, k, v, dropout_p=0.0, mask=None):
        seen.append(q.dtype)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only supports fp16 and bf16")
        return core(q, k, v, dropout_p, mask)
    return run


def strict_cores(model, seen: list):
    for block in model.layers.values():
        block.attn.core = sixteen_bit_only(block.attn.core, seen)
    return model


def test_one_process_samples_in_its_compute_dtype(tmp_path):
    from megaulysses.config import parse_args
    from megaulysses.training.trainer import Trainer
    trainer = Trainer(parse_args(ARGS + ["--data-cache-path", str(tmp_path)]))
    trainer.train()
    seen = []
    strict_cores(trainer.model, seen)
    text = trainer.generate()
    assert isinstance(text, str)
    assert len(seen) == 4 * 2 and set(seen) == {torch.bfloat16}  # 4 tokens x 2 layers


def sample_on_grid(rank, world, args):
    """Rank 0: (the device its sampling model was built on, the dtypes its cores saw)."""
    import megaulysses.training.sampling as sampling
    import megaulysses.training.trainer as trainer_mod
    from megaulysses.config import parse_args
    built, seen = [], []
    real_build = sampling.build_model

    def build(cfg, core, seed, device):
        built.append(str(device))
        return strict_cores(real_build(cfg, core, seed, device), seen)
    sampling.build_model = build
    trainer = trainer_mod.Trainer(parse_args(args))
    trainer.train()
    text = trainer.generate()  # every rank takes part in gathering the model
    return built, [str(d) for d in seen], text


def test_grid_samples_on_rank0_cpu_in_its_compute_dtype(tmp_path):
    args = ARGS + ["--ds-sequence-parallel-size", "2", "--data-cache-path", str(tmp_path)]
    (built, seen, text), (built1, seen1, text1) = run_ranks(sample_on_grid, 2, args)
    assert built == ["cpu"] and isinstance(text, str)
    assert len(seen) == 8 and set(seen) == {"torch.bfloat16"}
    assert (built1, seen1, text1) == ([], [], None)  # rank 1 only helps gather
