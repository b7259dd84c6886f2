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

Overlap (parallel/a2a_overlap.py; on unless the Ulysses wrapper has `overlap` off, the
same results bit for bit): group g+1's q, k, v exchanges are issued before group g's
checkpoint runs and waited for inside group g+1's (its forward uses the results; its
recomputation, which gets no such head start, exchanges its saved inputs again, blocking),
and group g's output exchange is issued at the end of its group and waited for after
group g+1's core. Backward mirrors it by autograd's order: group g-1's output gradient is
exchanged while group g's recomputation and core backward run, and group g's input
gradients while group g-1's do. The memory contract: a checkpoint keeps what it kept (a
not-yet-waited exchange is a 0-element token to it); what is live grows by one group's
exchanges in flight, so at most two groups' whole-sequence tensors at once: forward the
next group's q, k, v (sent and received) and the group before's output, backward the group
before's input gradients (planner/memory/cores.py counts the forward's; why not the
backward's, measured, is said there). The recomputation's
exchanges (`regroup_bytes_per_layer`) are the ones not hidden.

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
from megaulysses.parallel.blocks import blocks
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
    for layer in blocks(model):
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
        # one group ahead (a2a_overlap.py) under Ulysses, unless its wrapper says not
        self.overlapped = self.exchange is not None and self.exchange.overlap

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
            kv, ahead = self._kv_whole(qkv, qs[0])
            ks, vs = ([heads[g * kv_r // G] for g in range(G)]  # G views [b, S, 1, d]
                      for heads in (t.split(1, dim=2) for t in kv))
            del kv
        else:  # grouped like q: G views [b, s, P, kv_r/G, d]
            ks, vs = (t.unflatten(2, (P, G, kv_r // G)).unbind(3) for t in qkv)
            ahead = self._start(qs[0], ks[0], vs[0], whole) if self.overlapped else None
        qkv.clear()
        drops = [drop.shifted(first + g * n) if drop is not None else 0.0 for g in range(G)]
        if self.overlapped:
            outs = self._overlapped(qs, ks, vs, whole, drops, mask, ahead)
        else:
            outs = [self._run(qs[g], ks[g], vs[g], whole, drops[g], mask) for g in range(G)]
        del qs, ks, vs, ahead
        # [b, s, P, n, d] each -> [b, s, P, G, n, d]: the heads' places without groups;
        # stack's backward hands each group a view of the gradient (a group's exchange
        # then copies its 1/G share contiguous, as its forward did)
        return torch.stack([o.unflatten(2, (P, n)) for o in outs], dim=3).flatten(2, 4)

    def _kv_whole(self, kv: list, q0: torch.Tensor) -> tuple[list, Optional[_GroupIO]]:
        """(k, v exchanged whole, emptying `kv`; overlapped, group 0's inputs: its q issued
        behind them, in flight while they are waited for)."""
        if self.exchange is None:
            return list(kv), None
        if not self.overlapped:
            return self.exchange.kv_to_heads(kv), None
        pending = self.exchange.kv_start_heads(kv)
        ahead = self._start(q0, None, None, True)
        return [p.wait() for p in pending], ahead

    def _overlapped(self, qs, ks, vs, whole: bool, drops: list, mask,
                    ahead: Optional[_GroupIO]) -> list:
        """The groups one ahead (a2a_overlap.py), from group 0's inputs issued (`ahead`):
        group g+1's q, k, v exchanges are issued before group g's core runs, and group
        g's output is waited for after group g+1's core; the exchanged outputs, in order."""
        G, outs, done = self.groups, [], None
        for g in range(G):
            io = ahead
            ahead = self._start(qs[g + 1], ks[g + 1], vs[g + 1], whole) if g + 1 < G \
                else None
            running = self._run(qs[g], ks[g], vs[g], whole, drops[g], mask, io)
            if done is not None:
                outs.append(done.wait())  # [b, s, P*n, d]
            done = running
            del io, running
        assert done is not None, "a layer has at least one head group"
        outs.append(done.wait())
        return outs

    def _start(self, q, k, v, whole: bool) -> _GroupIO:
        """A group's input exchanges issued: q, and k and v unless exchanged whole."""
        ex = self.exchange
        assert ex is not None, "overlapped only under Ulysses"
        return _GroupIO([ex.start_heads(q)] + ([] if whole else [ex.start_heads(k),
                                                                   ex.start_heads(v)]))

    def _run(self, q, k, v, whole: bool, dropout_p, mask, io: Optional[_GroupIO] = None):
        """One group, under grad in a checkpoint of its own."""
        args = (q, k, v, whole, dropout_p, mask, io)
        if not torch.is_grad_enabled():
            return self._group(*args)
        # Its own recomputation stops at the core's last saved tensor (the output
        # exchange saves nothing, so it is not sent again); nested in a block's
        # checkpoint too, whose setting is not the one in effect here.
        with set_checkpoint_early_stop(True):
            return checkpoint(self._group, *args, use_reentrant=False)

    def _group(self, q, k, v, whole: bool, dropout_p: float, mask,
               io: Optional[_GroupIO] = None):
        """One group: q `[b, s, P, n, d]`; k, v the same with their heads, or exchanged
        already (`whole`, `[b, S, 1, d]`) -> out `[b, s, P*n, d]`. Overlapped (`io`): the
        input exchanges issued already, and the output's `Exchange` returned, issued;
        recomputed, exchanged again here, the output not at all (its result is unused)."""
        recomputed = io is not None and io.ran
        if io is not None and not recomputed:
            assert io.inputs is not None, "kept until the group's first run"
            q, *kv = (e.wait() for e in io.inputs)  # [b, S, 1, n, d]
            k, v = kv if kv else (k, v)
            io.inputs = None
        elif self.exchange is not None:
            q = self.exchange.to_heads(q)  # [b, S, 1, n, d]
            if not whole:
                k, v = self.exchange.to_heads(k), self.exchange.to_heads(v)
        q, k, v = (t.flatten(2, 3) if t.dim() == 5 else t for t in (q, k, v))  # [b, S, n, d]
        out = self.core(q, k, v, dropout_p, mask)  # [b, S, n, d]
        del q, k, v
        if recomputed:
            return out
        if io is not None:
            io.ran = True
            assert self.exchange is not None, "overlapped (`io`) only under Ulysses"
            return self.exchange.start_sequence(out)  # waited for after the next group's core
        if self.exchange is not None:
            out = self.exchange.to_sequence(out)  # [b, s, P*n, d]
        return out


class _GroupIO:
    """An overlapped group's exchanges: its inputs', issued a group ahead; `ran` once its
    forward ran (a second run is its checkpoint's recomputation)."""

    def __init__(self, inputs: list):
        self.inputs: Optional[list] = inputs
        self.ran = False
