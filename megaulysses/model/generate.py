"""Sampling from a trained GPT: top-k, temperature, no KV cache (it is a demo, not a server)."""

from __future__ import annotations

import torch


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], num_tokens: int, max_context: int,
           vocab_size: int, temperature: float = 0.8, top_k: int = 40,
           seed: int = 0) -> list[int]:
    """Append `num_tokens` sampled tokens to `prompt`; returns only the new tokens.

    `model`: a whole single-device GPT. Logits of padded vocabulary entries
    (>= vocab_size) are never sampled.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    for _ in range(num_tokens):
        context = ids[-max_context:]
        logits = model(torch.tensor([context], device=device))  # [1, s, V]
        logits = logits[0, -1, :vocab_size].float().cpu()  # [V]
        logits = logits / temperature
        if 0 < top_k < vocab_size:
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    model.train(was_training)
    return ids[len(prompt):]
