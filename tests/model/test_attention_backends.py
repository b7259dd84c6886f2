"""The backend list: which backend runs which mask, and flex_attention's mask translation
(forward on CPU, where torch runs flex compiled but has no flex backward)."""

import pytest
import torch

from megaulysses.model.attention import (AttentionMask, SparseLayout, cpu_attention,
                                         flex_attention, math_attention, select_backend)

CPU = torch.device("cpu")
WINDOW = AttentionMask(window=24)
SPARSE = AttentionMask(layout=SparseLayout("bigbird", 16, 2, 1, 1, seed=3))


def test_auto_on_cpu_picks_the_block_kernel_for_masks():
    assert select_backend("auto", CPU) == ("sdpa", cpu_attention)
    assert select_backend("auto", CPU, mask=WINDOW)[0] == "block"
    assert select_backend("auto", CPU, documents=True)[0] == "block"
    assert select_backend("math", CPU, mask=SPARSE)[0] == "math"


@pytest.mark.parametrize("name,mask,documents,dropout,words", [
    ("sdpa", WINDOW, False, 0.0, "--window-size: the sdpa attention backend cannot run it"),
    ("sdpa", AttentionMask(), True, 0.0, "--reset-attention-mask: the sdpa"),
    ("block", AttentionMask(), False, 0.1, "--attention-dropout: the block"),
    ("auto", SPARSE, False, 0.1, "--attention-dropout: the block"),
    ("flex", WINDOW, False, 0.0, "--attention-backend: flex needs CUDA"),
    ("flash", AttentionMask(), False, 0.0, "--attention-backend: flash needs CUDA"),
])
def test_a_backend_refuses_what_it_cannot_run(name, mask, documents, dropout, words):
    with pytest.raises(ValueError, match=words):
        select_backend(name, CPU, mask=mask, documents=documents, dropout=dropout)


def test_flex_mask_translation_matches_math():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 128, 4, 16, generator=g)
    k, v = (torch.randn(2, 128, 2, 16, generator=g) for _ in range(2))
    docs = torch.tensor([[0] * 50 + [1] * 78, [0] * 10 + [1] * 118])
    for mask in (WINDOW, AttentionMask(documents=docs, window=40), SPARSE):
        torch.testing.assert_close(flex_attention(q, k, v, 0.0, mask),
                                   math_attention(q, k, v, 0.0, mask), rtol=1e-5, atol=1e-5)
