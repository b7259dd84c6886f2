"""Sampling from a trained GPT: top-k, temperature, no KV cache (it is a demo, not a server)."""

from __future__ import annotations

import torch


@torch.no_grad()
def sample(model, prompt: list[int], num_tokens: int, max_context: int, vocab_size: int,
           temperature: float = 0.8, top_k: int = 40, seed: int = 0,
           length_multiple: int = 1) -> list[int]:
    """Append `num_tokens` sampled tokens to `prompt`; returns only the new tokens.

    Logits of padded vocabulary entries (>= vocab_size) are never sampled. A model that
    needs sequence lengths divisible by `length_multiple` (sequence parallelism) gets the
    context padded on the right: attention is causal, so the padding never changes the
    logits of the real tokens before it.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    for _ in range(num_tokens):
        context = ids[-max_context:]
        last = len(context) - 1
        context = context + [0] * (-len(context) % length_multiple)
        logits = model(torch.tensor([context], device=device))  # [1, s, V]; vocab-sharded
                                                                 # under tensor parallelism
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        logits = logits[0, last, :vocab_size].float().cpu()  # [V]
        logits = logits / temperature
        if 0 < top_k < vocab_size:
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    model.train(was_training)
    return ids[len(prompt):]
