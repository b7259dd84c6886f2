"""The backend list: which backend runs which mask; flex_attention's mask translation
(forward on CPU, where torch runs flex compiled but has no flex backward) and its block
mask (the same tiles as torch's, once per batch, never s x s); flash-attn's varlen
arguments (once per batch, no host sync per layer); SDPA's GQA path on CUDA."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megaulysses.model.attention import (AttentionMask, SparseLayout, cpu_attention,
                                         flex_attention, math_attention, select_backend)
from helpers import llama_config

CPU = torch.device("cpu")
WINDOW = AttentionMask(window=24)
SPARSE = AttentionMask(layout=SparseLayout("bigbird", 16, 2, 1, 1, seed=3))


def test_auto_on_cpu_picks_the_block_kernel_for_masks():
    assert select_backend("auto", CPU) == ("sdpa", cpu_attention)
    assert select_backend("auto", CPU, mask=WINDOW)[0] == "block"
    assert select_backend("auto", CPU, documents=True)[0] == "block"
    assert select_backend("math", CPU, mask=SPARSE)[0] == "math"
    # attention dropout: the block kernel's positional mask, whatever the mask
    assert select_backend("auto", CPU, dropout=0.1)[0] == "block"
    assert select_backend("auto", CPU, mask=SPARSE, dropout=0.1)[0] == "block"
    assert select_backend("block", CPU, dropout=0.1)[0] == "block"


@pytest.mark.parametrize("name,mask,documents,dropout,words", [
    ("sdpa", WINDOW, False, 0.0, "--window-size: the sdpa attention backend cannot run it"),
    ("sdpa", AttentionMask(), True, 0.0, "--reset-attention-mask: the sdpa"),
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


def test_flex_matches_sdpa_with_a_window_mask():
    """flex's compiled forward (CPU) with the window's block mask == torch SDPA given the
    window as a dense boolean mask (k, v repeated to the query heads)."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 128, 4, 16, generator=g)
    k, v = (torch.randn(2, 128, 2, 16, generator=g) for _ in range(2))
    i, j = torch.arange(128).view(-1, 1), torch.arange(128).view(1, -1)
    allowed = (j <= i) & (j > i - WINDOW.window)  # [s, s]
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), *(t.repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v)),
        attn_mask=allowed).transpose(1, 2)
    torch.testing.assert_close(flex_attention(q, k, v, 0.0, WINDOW), want, rtol=1e-5,
                               atol=1e-5)


# -- flex's block mask: from block kinds, once per batch, never s x s -------------------------

DOCS = torch.tensor([[0] * 100 + [1] * 300 + [2] * 240, [0] * 623 + [1] * 17])  # [2, 640]
BLOCK_MASKS = {
    "causal": AttentionMask(), "window": AttentionMask(window=200),
    "documents": AttentionMask(documents=DOCS),
    "documents+window": AttentionMask(documents=DOCS, window=150),
    "bigbird-32": AttentionMask(layout=SparseLayout("bigbird", 32, 2, 1, 1, seed=3)),
    "fixed-256": AttentionMask(layout=SparseLayout("fixed", 256, 2, 1)),
}


def _tiles(block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool `[b, h, n, n]` of a BlockMask's key-tile lists."""
    def dense(num, idx):
        out = torch.zeros(idx.shape, dtype=torch.bool)
        for row in torch.cartesian_prod(*(torch.arange(n) for n in num.shape)).tolist():
            out[tuple(row)][idx[tuple(row)][:num[tuple(row)]].long()] = True
        return out
    return (dense(block_mask.kv_num_blocks, block_mask.kv_indices),
            dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices))


@pytest.mark.parametrize("s", [640, 600], ids=["whole-tiles", "last-tile-cut"])
@pytest.mark.parametrize("name", list(BLOCK_MASKS))
def test_flex_block_mask_equals_torch_create_block_mask(name, s):
    """Built from block kinds, the same tiles as torch's create_block_mask, which evaluates
    the element mask on all s x s pairs (the reference, at a small s)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from megaulysses.model.attention import flex_block_mask
    mask = BLOCK_MASKS[name]
    if mask.documents is not None:
        mask = mask.with_documents(mask.documents[:, :s])
    pos = torch.arange(s)
    allowed = mask.allows(pos, pos)  # [b or 1, s, s]
    per_sample = mask.documents is not None
    ref = create_block_mask(lambda b, h, i, j: allowed[b if per_sample else 0, i, j],
                            allowed.shape[0] if per_sample else None, None, s, s, device="cpu")
    got = flex_block_mask(mask, s, "cpu")
    assert got.seq_lengths == (s, s)
    for ours, theirs in zip(_tiles(got), _tiles(ref), strict=True):
        assert torch.equal(ours, theirs)


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op makes (inputs and outputs)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("mask", [
    AttentionMask(window=1024, documents=torch.arange(4096).div(700, rounding_mode="floor")
                  .expand(2, 4096)),
    AttentionMask(layout=SparseLayout("bigbird", 16, 4, 1, 2, seed=1)),
], ids=["documents+window", "bigbird-16"])
def test_flex_block_mask_never_makes_an_s_by_s_tensor(mask):
    """s = 4096: torch's create_block_mask (eager) makes a [b, 1, s, s] bool (plus its
    int64 sum); ours holds tiles and position ranges: b * s ids at most with documents,
    (s / layout block)^2 layout blocks with a layout finer than a tile."""
    from megaulysses.model.attention.kernels import _build_flex_block_mask
    s = 4096
    with _LargestTensor() as seen:
        _build_flex_block_mask(mask, s, torch.device("cpu"))
    bound = 2 * s if mask.layout is None else (s // mask.layout.block) ** 2
    assert 0 < seen.largest <= bound < s * s // 64


def _count_calls(monkeypatch, module, name) -> list:
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_flex_block_mask_built_once_per_batch(monkeypatch, recompute):
    """A 3-layer GPT on the flex core with packed documents, forward and backward (and
    backward's recomputation): one block mask per batch, not one per layer or recompute.
    Flex has no backward on CPU: its compiled kernel is replaced by SDPA here (the values
    do not matter, only how often the block mask is built)."""
    import torch.nn.functional as F
    from megaulysses.model.attention import kernels
    from megaulysses.model.gpt import build_model
    from megaulysses.parallel.recompute import apply_recompute
    monkeypatch.setattr(kernels, "_compiled_flex", lambda: lambda q, k, v, block_mask,
                        enable_gqa: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                   enable_gqa=enable_gqa))
    builds = _count_calls(monkeypatch, kernels, "_build_flex_block_mask")
    cfg = llama_config(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=256,
                      vocab_size=64)
    model = apply_recompute(build_model(cfg, kernels.flex_attention, 0), recompute)
    tokens = torch.randint(0, 64, (2, 256))
    for batch in range(1, 3):
        docs = torch.arange(256).div(40 + batch, rounding_mode="floor").expand(2, 256)
        model(tokens, labels=tokens, documents=docs).sum().backward()
        assert len(builds) == batch


def test_flex_static_block_mask_built_once_per_run(monkeypatch):
    """Without documents the block mask depends on the length only: one for all batches."""
    from megaulysses.model.attention import kernels
    kernels._static_flex_block_mask.cache_clear()
    builds = _count_calls(monkeypatch, kernels, "_build_flex_block_mask")
    for _ in range(3):  # three batches' masks: new objects, the same rule
        first = kernels.flex_block_mask(AttentionMask(window=24), 256, "cpu")
    assert len(builds) == 1 and first is kernels.flex_block_mask(WINDOW, 256, "cpu")


# -- flash-attn's varlen arguments: once per batch, no host sync per layer --------------------

def _cu_seqlens_reference(documents: torch.Tensor) -> tuple[list, int]:
    """Runs of equal ids, sample by sample, as offsets in the flattened batch."""
    starts, lengths, offset = [], [], 0
    for row in documents.tolist():
        for i, doc in enumerate(row):
            if i == 0 or doc != row[i - 1]:
                starts.append(offset + i)
                lengths.append(0)
            lengths[-1] += 1
        offset += len(row)
    return starts + [offset], max(lengths)


@pytest.mark.parametrize("documents", [
    torch.zeros(1, 16, dtype=torch.long),  # one document
    torch.arange(8).view(1, 8),  # every token its own
    torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0], [3, 4, 4, 4, 4, 9]]),
    torch.tensor([[0] * 9 + [1] * 30 + [2] * 25, [0] * 40 + [1] + [2] * 23]),
], ids=["one", "singletons", "mixed", "ring-test"])
def test_document_cu_seqlens_matches_reference(documents):
    from megaulysses.model.attention import document_cu_seqlens
    cu_seqlens, longest = document_cu_seqlens(documents)
    want_cu, want_longest = _cu_seqlens_reference(documents)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == want_cu
    assert isinstance(longest, int) and longest == want_longest


def test_document_cu_seqlens_random_against_reference():
    from megaulysses.model.attention import document_cu_seqlens
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        docs = (torch.rand(3, 50, generator=g) < 0.1).long().cumsum(dim=1)  # [3, 50]
        cu_seqlens, longest = document_cu_seqlens(docs)
        assert (cu_seqlens.tolist(), longest) == _cu_seqlens_reference(docs)


class _HostSyncs(TorchDispatchMode):
    """Records the ops that make a host wait for the device: reading a value (`.item()`,
    `int(t)`, `bool(t)`: _local_scalar_dense), data-dependent shapes (nonzero, ...),
    copies to the CPU (a no-op here, but the call is seen)."""
    SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
             "unique_consecutive", "repeat_interleave")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        to_cpu = name in ("_to_copy", "to", "copy_") and "cpu" in str((kwargs or {}).get(
            "device", ""))
        if name in self.SYNCS or to_cpu:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_flash_varlen_layers_make_no_host_sync(monkeypatch):
    """The flash core with packed documents, flash_attn's functions faked (it needs CUDA):
    cu_seqlens and max_seqlen are made once, by the first layer; the next layers pass the
    same values on and make no host sync."""
    from megaulysses.model.attention import kernels
    received = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):  # [b * s, h, d] -> [b * s, h, d]
        received.append((cu_q, cu_k, max_q, max_k))
        return torch.zeros_like(q)

    monkeypatch.setattr(kernels, "_flash_attn_funcs", lambda: (None, varlen))
    builds = _count_calls(monkeypatch, kernels, "document_cu_seqlens")
    docs = torch.tensor([[0] * 9 + [1] * 30 + [2] * 25, [0] * 40 + [1] + [2] * 23])
    mask = AttentionMask(documents=docs)
    q = torch.randn(2, 64, 4, 8)
    k = v = torch.randn(2, 64, 2, 8)
    kernels.flash_attention(q, k, v, 0.0, mask)  # the first layer builds them
    with _HostSyncs() as syncs:
        for _ in range(3):
            kernels.flash_attention(q, k, v, 0.0, mask)
    assert syncs.seen == [] and len(builds) == 1
    assert all(r[0] is received[0][0] and r[1] is r[0] for r in received)
    assert received[0][0].tolist() == [0, 9, 39, 64, 104, 105, 128] and received[0][2] == 40
    with _HostSyncs() as building:  # the spy sees what building them costs
        kernels.document_cu_seqlens(docs)
    assert "nonzero" in building.seen and "_local_scalar_dense" in building.seen


# -- SDPA: GQA without the math kernel's s x s scores on CUDA ---------------------------------

@pytest.mark.parametrize("device,dtype,hq,hkv,d,repeats", [
    ("cuda", torch.float32, 8, 2, 64, True),  # no flash kernel in fp32: efficient, no GQA
    ("cuda", torch.bfloat16, 8, 2, 64, False),  # the flash kernel runs GQA
    ("cuda", torch.float16, 8, 2, 128, False),
    ("cuda", torch.bfloat16, 8, 2, 320, True),  # head dim > 256: no flash kernel
    ("cuda", torch.bfloat16, 8, 2, 60, True),  # head dim not a multiple of 8
    ("cuda", torch.float32, 8, 8, 64, False),  # no GQA: nothing to repeat
    ("cpu", torch.float32, 8, 2, 64, False),  # CPU flash kernel: GQA in every dtype
    ("cpu", torch.bfloat16, 8, 2, 64, False),
])
def test_sdpa_repeats_kv_where_cuda_would_fall_to_math(device, dtype, hq, hkv, d, repeats):
    from megaulysses.model.attention import sdpa_repeats_kv
    assert sdpa_repeats_kv(device, dtype, hq, hkv, d) is repeats


def test_sdpa_with_repeated_kv_equals_enable_gqa(monkeypatch):
    from megaulysses.model.attention import kernels
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 64, 8, 16, generator=g)
    k, v = (torch.randn(2, 64, 2, 16, generator=g) for _ in range(2))
    native = kernels.sdpa_attention(q, k, v)
    monkeypatch.setattr(kernels, "sdpa_repeats_kv", lambda *a: True)
    torch.testing.assert_close(kernels.sdpa_attention(q, k, v), native, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(native, math_attention(q, k, v), rtol=1e-4, atol=1e-5)
