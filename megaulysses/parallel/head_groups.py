"""Attention by groups of heads (--attention-head-groups G): a smaller per-layer working
set.

Each layer runs its attention as G consecutive pieces, each over 1/G of the heads this rank
attends with: under Ulysses (sp = P > 1) piece g is the all-to-all of its share of q, k and
v, the core, and the output's all-to-all back; without Ulysses the core alone on a share of
the local heads. So the whole-sequence `[b, S, hq/(P*G), d]` q, k, v and out exist for one
group at a time, and under grad each piece is one non-reentrant checkpoint: forward keeps
the group's inputs only (views of the rank's `[b, S/P, h, d]` q, k, v), and backward reruns
the group right before its own backward. Under full recomputation this is the difference
that matters: without groups the layer's backward holds every head's whole-sequence q, k,
v, out and their gradients at once (2 x (2Q + 2K) in the memory plan's notation), with
groups one group's share of them.

Which heads. Ulysses' all-to-all gives rank i the i-th of P contiguous chunks of the heads.
Group g takes from each chunk its g-th sub-chunk (q viewed `[b, s, P, G, hq/(P*G), d]`,
index g on the G axis), so after its all-to-all rank i holds sub-chunk g of its own chunk:
the G groups compute exactly the heads of the ungrouped layer, each head with the same
arithmetic, and their back-exchanged outputs fill the same places of `[b, s, hq, d]`. kv:
the rank attends with kv_r = max(hkv, P)/P kv heads (the config rule: G and kv_r divide
one another). kv_r a multiple of G: k and v are grouped like q (group g's kv heads are the
ones its q heads read). Else (G a multiple of kv_r, e.g. one kv head per rank at P = hkv):
k and v are exchanged whole once per layer, as without groups (the GQA repeat included),
outside the checkpoints, and group g reads kv head g*kv_r/G, the one all its q heads read.

What it costs: each group's recomputation in backward sends its q, k, v again (q alone
when k, v were exchanged whole) and reruns the core's forward (the ring's included), but
not the output's exchange: the group's recomputation stops at the core's last saved tensor
(torch's early stop; the output all-to-all saves nothing). Per layer, bytes on top of
`ulysses_bytes_per_layer` (`regroup_bytes_per_layer`): b*S*d*e*(P-1)/P^2 * (hq +
2*max(hkv, P)), or * hq when k and v go whole. Under full recomputation the block's
checkpoint no longer stops early (below): its last sublayer output is reduced again under
tensor parallelism, as with the tiled MLP.

Composes with: the ring (the core inside Ulysses; a group's core is the ring over its
heads); masks (passed unchanged); tensor parallelism (the rank's local heads: q, k, v are
plain tensors here); selective recomputation (the group's checkpoint already recomputes
the core: its RecomputedCore is unwrapped, no core runs three times); full recomputation
(a checkpoint inside the block's: parallelize.py turns the block's early stop off, as for
the tiled MLP, see recompute.py); attention dropout (one key per layer, each group's
heads shifted to their global index: the positional masks of dropout.py, the ungrouped
layer's exactly, and its recomputation's; a fused kernel's own dropout, SDPA's or
flash's, draws by its own RNG, the same again in recomputation, whose checkpoint restores
the RNG, but not the ungrouped layer's masks); pipeline and ZeRO-3 (a group holds no parameters:
FSDP's hooks never see it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from megaulysses.model.attention.dropout import as_dropout
from megaulysses.parallel.recompute import RecomputedCore
from megaulysses.parallel.ulysses import UlyssesAttention

if TYPE_CHECKING:
    from megaulysses.model.attention import AttentionCore
    from megaulysses.model.gpt import GPT


def regroup_bytes_per_layer(b: int, S: int, hq: int, hkv: int, d: int, P: int,
                            element_size: int, groups: int) -> int:
    """All-to-all bytes one rank sends per layer beyond `ulysses_bytes_per_layer` forward
    and backward: the groups' recomputation sends q, k and v again (q alone where k and v
    go whole), not the output. hq, hkv: the tensor-parallel rank's heads; S: the ring
    rank's positions."""
    if groups == 1 or P == 1:
        return 0
    kv = max(hkv, P)  # after the GQA repeat
    heads = hq + (2 * kv if (kv // P) % groups == 0 else 0)
    return heads * b * S * d * element_size * (P - 1) // (P * P)


def apply_head_groups(model: GPT, groups: int) -> GPT:
    """Run every block's attention by `groups` groups of heads (in place; 1: unchanged).
    After Ulysses and recomputation: it takes the Ulysses wrapper (or the plain core) and
    unwraps the RecomputedCore that --recompute-activations put inside."""
    if groups == 1:
        return model
    for layer in model.layers.values():
        if layer is not None:
            layer.attn.core = HeadGroups(layer.attn.core, groups)
    return model


class HeadGroups:
    """An attention core `(q, k, v, dropout_p, mask) -> out`, `[b, s, h, d]` each, that runs
    `inner` (a UlyssesAttention, or a plain core) by `groups` groups of the heads."""

    takes_qkv = True  # SelfAttention hands q, k, v over (see UlyssesAttention.take)

    def __init__(self, inner, groups: int):
        self.groups = groups
        self.exchange: Optional[UlyssesAttention] = (
            inner if isinstance(inner, UlyssesAttention) else None)
        core = inner.core if self.exchange is not None else inner
        # The group's checkpoint recomputes the core already: a checkpoint of its own
        # inside would run it a third time.
        self.core: AttentionCore = core.core if isinstance(core, RecomputedCore) else core
        self.P = self.exchange.P if self.exchange is not None else 1

    def __call__(self, q, k, v, dropout_p: float = 0.0, mask=None):
        return self.take([q, k, v], dropout_p, mask)

    def take(self, qkv: list, dropout_p: float = 0.0, mask=None) -> torch.Tensor:
        """`qkv` = [q `[b, s, hq, d]`, k, v `[b, s, hkv, d]`], emptied (the caller's last
        references; s = S/P under Ulysses) -> out `[b, s, hq, d]`."""
        G, P = self.groups, self.P
        q = qkv.pop(0)
        hq, hkv = q.shape[2], qkv[0].shape[2]
        n = hq // (P * G)  # q heads of a group on a rank
        # One key for the layer, drawn here (not once per group): group g on Ulysses rank r
        # attends heads r * hq/P + g * n + (0..n-1), and its dropout is shifted there, so
        # its mask is the ungrouped layer's for those heads (dropout.py).
        drop = as_dropout(dropout_p)
        first = self.exchange.comm.rank(self.exchange.dim) * (hq // P) if self.exchange \
            else 0
        qs = q.unflatten(2, (P, G, n)).unbind(3)  # G views [b, s, P, n, d]
        del q
        kv_r = max(hkv, P) // P  # kv heads the rank attends with
        whole = kv_r % G != 0
        if whole:  # G a multiple of kv_r: exchanged once, group g reads head g*kv_r/G
            kv = self.exchange.kv_to_heads(qkv) if self.exchange is not None else qkv
            ks, vs = ([heads[g * kv_r // G] for g in range(G)]  # G views [b, S, 1, d]
                      for heads in (t.split(1, dim=2) for t in kv))
            del kv
        else:  # grouped like q: G views [b, s, P, kv_r/G, d]
            ks, vs = (t.unflatten(2, (P, G, kv_r // G)).unbind(3) for t in qkv)
        qkv.clear()
        outs = []
        for g in range(G):
            group_drop = drop.shifted(first + g * n) if drop is not None else 0.0
            args = (qs[g], ks[g], vs[g], whole, group_drop, mask)
            if torch.is_grad_enabled():
                # Its own recomputation stops at the core's last saved tensor (the output
                # exchange saves nothing, so it is not sent again); nested in a block's
                # checkpoint too, whose setting is not the one in effect here.
                with set_checkpoint_early_stop(True):
                    outs.append(checkpoint(self._group, *args, use_reentrant=False))
            else:
                outs.append(self._group(*args))
            del args
        del qs, ks, vs
        # [b, s, P, n, d] each -> [b, s, P, G, n, d]: the heads' places without groups;
        # stack's backward hands each group a view of the gradient (a group's exchange
        # then copies its 1/G share contiguous, as its forward did)
        return torch.stack([o.unflatten(2, (P, n)) for o in outs], dim=3).flatten(2, 4)

    def _group(self, q, k, v, whole: bool, dropout_p: float, mask):
        """One group: q `[b, s, P, n, d]`; k, v the same with their heads, or exchanged
        already (`whole`, `[b, S, 1, d]`) -> out `[b, s, P*n, d]`."""
        if self.exchange is not None:
            q = self.exchange.to_heads(q)  # [b, S, 1, n, d]
            if not whole:
                k, v = self.exchange.to_heads(k), self.exchange.to_heads(v)
        q, k, v = (t.flatten(2, 3) if t.dim() == 5 else t for t in (q, k, v))  # [b, S, n, d]
        out = self.core(q, k, v, dropout_p, mask)  # [b, S, n, d]
        del q, k, v
        if self.exchange is not None:
            out = self.exchange.to_sequence(out)  # [b, s, P*n, d]
        return out
