"""Sampling from the trained model at the end of a run (--generate)."""

from __future__ import annotations

from typing import Optional

import torch

from megaulysses.model.attention import mask_from_config, select_backend
from megaulysses.model.generate import sample
from megaulysses.model.gpt import build_model
from megaulysses.parallel.pipeline import full_state_dict
from megaulysses.training.run import Run, autocast


def generate_text(run: Run) -> Optional[str]:
    """Rank 0 samples --generate tokens in the compute dtype (autocast), through an
    attention core chosen for the device and dtype it runs in; other ranks return None.
    One process samples from its own model; on a grid the shards and stages are gathered
    (every rank takes part) into a whole model on rank 0's CPU: no second whole model on
    the accelerator beside the training state."""
    cfg, t = run.cfg, run.cfg.train
    if not t.generate:
        return None
    model, device = run.parts.model, run.device
    if cfg.dims.world > 1:
        state = full_state_dict(model, run.comm)
        if run.rank != 0:
            return None
        assert state is not None, "rank 0 gathers the whole state"
        device = torch.device("cpu")
        core = select_backend("auto", device, run.dtype, mask_from_config(cfg.model))[1]
        model = build_model(cfg.model, core, t.seed, device)
        model.load_state_dict(state)
    tok = run.tokenizer
    # "" gives a tokenizer's start of a document where it adds one (Llama 3's bos under
    # --tokenizer-hf-include-special-tokens), else the previous document's end starts one
    prompt = tok.tokenize(t.generate_prompt or "") or [tok.eod]
    with autocast(device, run.dtype):
        new = sample(model, prompt, t.generate, cfg.model.seq_length, tok.vocab_size,
                     t.generate_temperature, t.generate_top_k, seed=t.seed)
    return tok.detokenize([i for i in new if i != tok.eod])
