"""A plain, single-device GPT (GPT-2 or Llama style). Imports nothing distributed.

Parallelism is applied from outside, as transforms: tensor parallel shards the linears,
Ulysses swaps each `SelfAttention.core`, pipeline drops the parts a stage does not own
(`embed`, entries of `layers`, `head` may be None; the last stage of a tied model keeps
`embed.word` for its output layer) and runs `run_layers` / `output` on its own layers,
ZeRO wraps blocks. Parameter names
(`layers.<global index>....`) never change, so initial values and checkpoints are the same
on every grid.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable, Optional, Protocol, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaulysses.config import ModelConfig
from megaulysses.model.attention import (AttentionCore, AttentionDropout, AttentionMask,
                                         mask_from_config, sdpa_attention)
from megaulysses.model.attention.dropout import DropoutArg
from megaulysses.model.ops import linear, linear_cross_entropy
from megaulysses.model.layers import MLP, EmbeddingTable, Linear, build_norm, shared_input
from megaulysses.model.rope import apply_rotary, rotary_angles


class _TakesQKV(Protocol):
    """A core with takes_qkv set (parallel/ulysses.py, head_groups.py, fpdt.py)."""

    def take(self, qkv: list, dropout_p: DropoutArg = 0.0,
             mask: Optional[AttentionMask] = None) -> torch.Tensor: ...


class SelfAttention(nn.Module):
    """q, k, v projections (biased under --add-bias-linear or --add-qkv-bias), per-head
    norms of q and k (--qk-layernorm), RoPE, the attention core, the out projection."""

    def __init__(self, cfg: ModelConfig, core: AttentionCore):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                            cfg.num_kv_heads, d)
        qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias
        self.q = Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        # One [d] norm each, shared by the heads (Qwen3): per head, so a rank holding some
        # heads (tensor parallel) or some tokens (Ulysses, ring) normalizes its own alone.
        self.q_norm: Optional[nn.Module] = None
        self.k_norm: Optional[nn.Module] = None
        if cfg.qk_layernorm:
            norm = (cfg.normalization, d, cfg.norm_epsilon, cfg.apply_layernorm_1p)
            self.q_norm, self.k_norm = build_norm(*norm), build_norm(*norm)
        self.out = Linear(self.num_heads * d, h, bias=cfg.add_bias_linear)
        self.core = core  # (q, k, v, dropout_p, mask) -> out; replaced by the Ulysses wrapper
        self.dropout = cfg.attention_dropout
        self.head_offset = 0  # global index of this module's first head (tensor parallel)

    def forward(self, x: torch.Tensor, rotary: Optional[tuple[torch.Tensor, torch.Tensor]],
                mask: Optional[AttentionMask] = None) -> torch.Tensor:
        # x [b, s, h]; rotary: (cos, sin) or None; mask: over the whole sequence, None: causal
        b, s, _ = x.shape
        use = shared_input(x)  # under autocast: one 16-bit copy of x for q, k and v, not three
        # -1 instead of the head count: tensor parallelism leaves a shard of the heads.
        q = self.q(use()).view(b, s, -1, self.head_dim)  # [b, s, hq, d]
        k = self.k(use()).view(b, s, -1, self.head_dim)  # [b, s, hkv, d]
        v = self.v(use()).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither: before
            # RoPE; fp32 out, back to the projections' dtype
            # (the norms keep q and k as they are, in that dtype)
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)
        if rotary is not None:
            q = apply_rotary(q, *rotary)
            k = apply_rotary(k, *rotary)
        qkv = [q, k, v]  # handed over: see `attend`
        del q, k, v
        y = self.attend(qkv, mask)  # [b, s, hq, d]
        return self.out(y.reshape(b, s, -1))  # [b, s, h]

    def attend(self, qkv: list[torch.Tensor],
               mask: Optional[AttentionMask] = None) -> torch.Tensor:
        """The attention core on `qkv` = [q, k, v] (emptied), with this call's dropout:
        `[b, s, hq, d]`. One method, so that --torch-compile can run it eagerly between the
        attention's two graphs where the core cannot be traced (parallel/compile.py)."""
        dropout: DropoutArg = 0.0
        if self.training and self.dropout:  # one key per call: every core, and a
            # recomputation, draws this call's masks (model/attention/dropout.py)
            dropout = AttentionDropout.draw(self.dropout, self.head_offset)
        if getattr(self.core, "takes_qkv", False):  # Ulysses, head groups: handed over, so
            # the core frees each sequence-sharded tensor once it has sent it (no other
            # reference here) instead of holding it beside its whole-sequence copy
            return cast(_TakesQKV, self.core).take(qkv, dropout, mask)  # [b, s, hq, d]
        q, k, v = qkv
        qkv.clear()
        return self.core(q, k, v, dropout, mask)  # [b, s, hq, d]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, core: AttentionCore):
        super().__init__()
        self.attn_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon,
                                    cfg.apply_layernorm_1p)
        self.attn = SelfAttention(cfg, core)
        self.mlp_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon,
                                    cfg.apply_layernorm_1p)
        self.mlp = MLP(cfg.hidden_size, cfg.ffn_size, cfg.swiglu, cfg.add_bias_linear,
                       cfg.gelu_approximate)
        self.dropout = cfg.hidden_dropout

    def forward(self, x: torch.Tensor, rotary: Optional[tuple[torch.Tensor, torch.Tensor]],
                mask: Optional[AttentionMask] = None) -> torch.Tensor:
        # x [b, s, h]; rotary: (cos, sin) [b, s, 1, d/2] or None
        a = self.attn(self.attn_norm(x), rotary, mask)
        return self.after_attention(x, a)

    def after_attention(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The residual adds around the MLP, given the attention's output `a`: `[b, s, h]`.
        (--torch-compile compiles it alone where the attention runs eagerly.)"""
        x = x + F.dropout(a, self.dropout, self.training)
        return x + F.dropout(self.mlp_part(x), self.dropout, self.training)

    def mlp_part(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, s, h]
        """Norm and MLP: per token, so the tiled MLP transform may run it on chunks of the
        sequence (it replaces this method on the instance)."""
        return self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    """Word (and learned position) embeddings: the residual stream's start, in the compute
    dtype (Megatron-LM's 16-bit residual), or fp32 under --fp32-residual-connection (the
    16-bit rows widened, summed in fp32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fp32_residual = cfg.fp32_residual_connection
        self.word = EmbeddingTable(cfg.padded_vocab_size, cfg.hidden_size)
        self.position = (EmbeddingTable(cfg.max_positions, cfg.hidden_size)
                         if cfg.position_embedding_type == "learned_absolute" else None)
        self.dropout = cfg.hidden_dropout

    def forward(self, tokens: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        x = self.word(tokens)  # the compute dtype
        if self.fp32_residual:
            x = x.float()
        if self.position is not None:  # (fp32 + 16-bit: summed in fp32)
            x = x + self.position(position_ids)
        return F.dropout(x, self.dropout, self.training)


class Head(nn.Module):
    """Final norm and output layer; the output weight is the word embedding when tied."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon,
                               cfg.apply_layernorm_1p)
        self.output = (Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
                       if cfg.untie_embeddings_and_output_weights else None)

    def forward(self, x: torch.Tensor,
                tied_weight: Optional[torch.Tensor]) -> torch.Tensor:  # [b, s, h] -> [b, s, V]
        x = self.norm(x)
        if self.output is not None:
            return self.output(x)
        return linear(x, _tied(tied_weight))

    def loss(self, x: torch.Tensor, labels: torch.Tensor,
             tied_weight: Optional[torch.Tensor]) -> torch.Tensor:  # -> [b, s] fp32
        """Per-token cross entropy of forward's logits, without holding all [b, s, V] logits
        at once (a fused op that works through chunks of tokens)."""
        weight = self.output.weight if self.output is not None else _tied(tied_weight)
        return linear_cross_entropy(self.norm(x), weight, labels)


def _tied(weight: Optional[torch.Tensor]) -> torch.Tensor:
    """The input embedding's weight, which a head without an output layer must be given."""
    if weight is None:
        raise ValueError("tied output weights: the head needs the embedding's weight")
    return weight


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, core: AttentionCore = sdpa_attention):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.layers = nn.ModuleDict({str(i): Block(cfg, core) for i in range(cfg.num_layers)})
        self.head = Head(cfg)
        self.rope = cfg.position_embedding_type == "rope"
        self.mask = mask_from_config(cfg)

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens `[b, s]` (or hidden `[b, s, h]` on a later pipeline stage).

        `documents` `[b, S]`: the document id of every token of the whole samples (packed
        documents, --reset-attention-mask), even where this rank holds a slice of them.
        Returns per-token losses `[b, s]` in fp32 when `labels` is given (the trainer
        reduces them with its loss mask), else logits `[b, s, V]`.
        """
        b, s = tokens.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(s, device=tokens.device).expand(b, s)
        x = self.embed(tokens, position_ids) if self.embed is not None else tokens
        x = self.run_layers(x, position_ids, self.layers.values(), documents)  # [b, s, h]
        return x if self.head is None else self.output(x, labels)

    def run_layers(self, x: torch.Tensor, position_ids: torch.Tensor, layers: Iterable[nn.Module],
                   documents: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:  # [b, s, h] -> [b, s, h]
        rotary = self.rotary(position_ids)
        mask = self.attention_mask(documents)
        for layer in layers:
            x = layer(x, rotary, mask)
        return x

    def attention_mask(self, documents: Optional[torch.Tensor] = None
                       ) -> Optional[AttentionMask]:
        """The model's mask with this batch's documents; None for plain causal."""
        mask = self.mask.with_documents(documents)
        return None if mask.is_causal else mask

    def rotary(self, position_ids: torch.Tensor
               ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """RoPE's (cos, sin) `[b, s, 1, d/2]` for these positions, once per forward and
        shared by every layer (None without RoPE)."""
        if not self.rope:
            return None
        return rotary_angles(position_ids, self.cfg)

    def output(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The head: per-token losses `[b, s]` with labels, else logits `[b, s, V]`."""
        tied = self.embed.word.weight if self.head.output is None else None
        if labels is None:
            return self.head(x, tied)
        return self.head.loss(x, labels, tied)

    @torch.no_grad()
    def init_weights(self, seed: int,
                     write: Optional[Callable[[torch.Tensor, torch.Tensor], object]] = None
                     ) -> None:
        """Initial values from (seed, parameter name, shape) only: equal on every grid.

        `write(param, value)` puts the whole `value` into `param`; a sharded parameter
        (tensor parallel, ZeRO-3) keeps only its own piece, so a rank holds one whole
        parameter at a time. Default: copy it all (a plain, whole model).
        """
        write = write or (lambda p, value: p.copy_(value))
        for name, p in self.named_parameters():
            write(p, initial_value(self.cfg, seed, name, tuple(p.shape)).to(p.dtype))


def initial_value(cfg: ModelConfig, seed: int, name: str, shape: tuple) -> torch.Tensor:
    """Megatron's scheme, on the CPU: normal(0, std) for weights, std/sqrt(2*layers) for the
    two output projections of each block, zero biases, unit norm weights (zero under
    --apply-layernorm-1p, which stores gamma - 1; q_norm and k_norm too)."""
    if name.endswith("norm.weight"):
        return torch.zeros(shape) if cfg.apply_layernorm_1p else torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = cfg.init_method_std
    if name.endswith(("attn.out.weight", "mlp.fc2.weight")):
        std = std / math.sqrt(2.0 * cfg.num_layers)
    return torch.normal(0.0, std, shape, generator=_generator(seed, name))


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


_CPU = torch.device("cpu")  # a module constant: B008 (torch.device is immutable anyway)


def build_model(cfg: ModelConfig, core: AttentionCore, seed: int,
                device: torch.device = _CPU) -> GPT:
    """A whole, single-device model: built on the meta device (no memory), materialized on
    `device`, initialized. (On a grid, parallel.parallelize builds it instead.)"""
    with torch.device("meta"):
        model = GPT(cfg, core)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the whole model, whatever part of it this rank holds (built on meta)."""
    with torch.device("meta"):
        return count_parameters(GPT(cfg))
