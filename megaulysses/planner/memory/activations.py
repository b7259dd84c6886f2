"""The memory plan's activations: what a micro-batch keeps for backward on this rank,
per layer and outside the layers, under recomputation, and what its backward adds
(`_Activations`).

Activations a layer keeps for backward, bytes (each term by name in `layer_terms`):
    attn norm    RMSNorm (fused): its input, the residual stream, r*T'*h, + rstd 4*T'
                 (LayerNorm: its input widened to fp32, mean, rstd: 4*T'*(h + 2))
    attn input   the normed input q, k, v save: one fp32 tensor 4*T*h (Megatron-SP: the
                 all-gathered whole one); under autocast one e-byte copy, e*T*h, which the
                 three share (layers.shared_input)
    qk norms     --qk-layernorm: as attn norm over rows of d, T*(hq + hkv) of them, on
                 q and k in the compute dtype: T*(hq + hkv)*(e*d + 4) (LayerNorm: 4*(d + 2))
    core         recompute none, CPU block kernel (fp32, no dropout, S <= 1024): q*scale,
                 k, v, out, 4*T*(2hq + 2kv)*d, and the causal probabilities: fp32, per
                 (sample, core head) the sum over query blocks of 64 rows of rows*keys,
                 ~S*(S+64)/2, core heads hq/sp; SDPA / flash: q, k, v, out, e*T*(2hq +
                 2kv)*d, and the fp32 logsumexp b*(hq/sp)*S; CPU SDPA with dropout
                 (--attention-backend sdpa: its math path): q, k, v + three fp32 S*S per
                 head (probabilities, mask, dropped); the block kernel of
                 model/attention/block.py (any mask but plain causal on CPU, any attention
                 dropout on CPU, --attention-backend block; its dropout mask is hashed
                 again in backward, never kept): q, k, v, out, e*(2Q + 2K), and
                 lse -- no probabilities (plain causal there runs the fused kernel of
                 model/attention/fused.py, which keeps the same, as SDPA); the ring (cp > 1,
                 parallel/ring.py, inside Ulysses) the same (its output merged in fp32,
                 saved in q's dtype), on either kernel;
                 selective: only the core's inputs (the checkpoint), e*T*(hq +
                 2kv)*d -- everything else is recomputed in backward
    out input    the out-projection's input, e*T*hq*d (none without Ulysses when it is the
                 core's saved output: SDPA's, the block kernel's and the ring's, all laid
                 out [b, s, h, d], contiguous)
    mlp norm     as attn norm
    mlp input    as attn input, for fc1 and gate: one copy under autocast, which they
                 share (layers.shared_input)
    mlp hidden   SwiGLU: gate out, silu out, fc1 out, their product, 4*e*T*f (GeLU: 2)
    dropout      with --hidden-dropout: two masks, 2 * e*T'*h on CPU (a mask in the
                 sublayer output's dtype), 2 * T'*h on CUDA (the fused dropout's bool mask)
  --tiled-mlp-chunks N > 1: mlp norm, input and hidden give way to the MLP's input (the
    residual stream, r*T'*h) that the per-chunk checkpoints keep.
  --recompute-granularity full: a checkpointed group keeps its input, r*T'*h; method
    block: the first --recompute-num-layers layers of a stage one by one, the rest keep
    everything. --cpu-offloading-num-layers N: the inputs of the groups starting in the
    first N layers of a stage are in host memory instead (`host`); a group's attention
    backward then also holds the previous group's input, on its way back (`prefetch`).
Outside the layers, per micro-batch: RoPE's cos and sin for the micro-batch's positions,
computed once per forward and shared by every layer, 2 * 4*T*d/2; the last stage keeps
the final norm (r*T'*h + 4*T'), the loss's input (e*T*h; under autocast also its e-byte copy of
the output weight, e*V*h), ~25 bytes a token of statistics and, when the fused cross
entropy has one chunk (T*V <= 2^23 elements on CPU, 2^28 on CUDA), its exps 4*T*V; a
non-last pipeline stage keeps its output (r*T'*h) until the micro-batch's backward; the
first stage under tp the lookup's mask and ids (~9 bytes a token), with dropout the
embedding's mask (r*T'*h on CPU, T'*h on CUDA).
"""

from __future__ import annotations

from megaulysses.config import Config
from megaulysses.planner.memory.chunked import fpdt_host_layers, fpdt_kept, fpdt_link
from megaulysses.planner.memory.cores import _core_backward, _core_forward, _core_terms
from megaulysses.planner.memory.shapes import F32, _RankLayout, _Shape


class _Activations:
    """What a micro-batch keeps for backward on this rank, and what its backward adds."""

    def __init__(self, s: _Shape, cfg: Config, rank: _RankLayout):
        mem = cfg.memory
        self.s, self.rank = s, rank
        self.chunks, self.recompute = mem.tiled_mlp_chunks, mem.recompute_granularity
        self.terms = _layer_terms(s, self.recompute == "selective", self.chunks)
        self.layers = rank.layers
        self.recomputed = 0  # full: the most a group's recomputation adds to what is kept
        self.rerun = (0, 0)  # full: (layers, groups) whose forward runs again
        self.host = 0  # full, --cpu-offloading-num-layers: group inputs in host memory
        self.prefetch = 0  # and the one on its way back during a group's attention backward
        self.layers_kept = sum(self.terms.values()) * self.layers
        if self.recompute == "full":
            self._full_recompute(mem)
        self.per_layer = self.layers_kept // max(1, self.layers)
        # FSDP (ZeRO-2/3) gathers the output weight in the compute dtype already, and the
        # distributed optimizer holds it so: autocast then makes no copy of it
        half = cfg.train.bf16 or cfg.train.fp16
        weight_cast = s.e != F32 and not (rank.zero_stage >= 2 or (
            half and rank.zero_stage <= 1 and cfg.parallel.use_distributed_optimizer))
        self.head = _head_kept(s, weight_cast) if rank.last else 0
        self.rotary = 2 * F32 * s.T * s.d // 2 if s.rope and self.layers else 0
        self.output = 0 if rank.last else s.r * s.Tr * s.h  # the pipeline keeps it
        self.embedding = 9 * s.T if rank.first and s.tp > 1 else 0  # vocab-parallel ids
        if rank.first and s.hidden_dropout:
            self.embedding += s.embed_mask_e * s.Tr * s.h
        self.tied = (not cfg.model.untie_embeddings_and_output_weights and rank.first
                     and rank.last)
        # --ds-sequence-parallel-fpdt-offloading: the attention's chunks in host memory
        # (chunked.py), and the bytes they move over the host link, per micro-batch
        group = mem.recompute_num_layers or 1
        self.fpdt_host = (fpdt_kept(s) * fpdt_host_layers(self.layers, self.recompute, group)
                          if s.fpdt_host else 0)
        self.fpdt_link = fpdt_link(s) * self.layers

    def _full_recompute(self, mem):
        """Full recomputation, per stage: a checkpointed group keeps its input, the others
        everything; the worst group's backward adds its layers back in full; which layers
        (and groups) run forward again."""
        from megaulysses.parallel.recompute import layer_groups
        layer = sum(self.terms.values())  # what a layer holds while recomputed
        x = self.s.r * self.s.Tr * self.s.h  # a group's input
        self.layers_kept, layers, groups = 0, 0, 0
        for n in (n for n in self.rank.stage_layers if n):
            cut = layer_groups(n, mem.recompute_method, mem.recompute_num_layers)
            host = [again and a < mem.cpu_offloading_num_layers for a, _, again in cut]
            kept = [0 if off else x if again else (end - a) * layer
                    for off, (a, end, again) in zip(host, cut, strict=True)]
            # A group's backward: the groups before it keep theirs, it holds all again.
            worst = max(sum(kept[:i]) + (end - a) * layer for i, (a, end, _) in enumerate(cut))
            if any(host[:-1]):  # an offloaded input comes back during attention backward
                self.prefetch = x
            self.recomputed = max(self.recomputed, worst - sum(kept))
            self.layers_kept += sum(kept)
            self.host += x * sum(host)
            layers += sum(end - a for a, end, again in cut if again)
            groups += sum(1 for *_, again in cut if again)
        self.rerun = (layers, groups)

    def per_micro_batch(self) -> int:
        return self.layers_kept + self.head + self.output + self.embedding + self.rotary

    def pending_kept(self, head: bool = False) -> int:
        """Zero-bubble: what the rank's chunks between their B and W passes keep beyond
        their activations: `rank.pending` of them. At a B, `rank.pending` - 1 and the
        running one's, which frees nothing (retain_graph) and ends with as much, of any of
        the rank's stages (the most); at the loss's W (`head`), of the last stage, the W
        recomputing the loss's exps (its B consumed them)."""
        if not self.rank.pending:
            return 0
        if head:
            exps = F32 * self.s.T * self.s.V if self.s.ce_kept else 0
            return self.rank.pending * self._weight_pass_inputs(self.rank.chunks - 1) + exps
        extra = max(self._weight_pass_inputs(i) for i in range(self.rank.chunks))
        return self.rank.pending * extra

    def _weight_pass_inputs(self, i: int) -> int:
        """What chunk i of the rank keeps from its B pass for its W pass. torch's B
        (`stage_backward_input`) keeps the graph (retain_graph) and the gradient reaching
        each node a weight's gradient comes from: per layer the norms' output gradients
        (fp32), q, k, v's, the out-projection's, fc1's (and gate's) and fc2's (the stage's
        last fc2: the received gradient itself, where that is in the compute dtype and
        whole); on the last stage the final norm's, the loss's exps freed (B consumed
        them); the stage input's gradient (its `.grad`) and the received output gradient
        (the p2p buffers count the running chunk's only). Stage 0 runs no B (its input
        needs no gradient): its W is the whole backward, after which the received
        gradient goes (measured)."""
        s, stage = self.s, self.rank.ids[i]
        last = self.rank.last and i == self.rank.chunks - 1
        stream = s.r * s.Tr * s.h
        if stage == 0:
            return 0 if last else stream
        heads = s.hq + 2 * s.hkv + (s.hq + s.hkv if s.qk_norm else 0)
        layer = (2 * F32 * s.Tr * s.h + s.e * s.T * heads * s.d + 2 * s.e * s.T * s.h
                 + (2 if s.swiglu else 1) * s.e * s.T * s.f)
        out = layer * self.rank.stage_layers[i] + stream
        if not last:
            shared = s.e * s.T * s.h if s.e == s.r and not s.mega_sp else 0
            return out + stream - shared
        return out + F32 * (s.Tr * s.h + s.T) - (F32 * s.T * s.V if s.ce_kept else 0)

    def last_layer_kept(self) -> int:
        """What the last layer's backward frees (full: a recomputed group frees what it
        brought back, counted as transient)."""
        return 0 if self.recompute == "full" else self.per_layer

    def backward_moments(self) -> dict:
        """{moment: this micro-batch's activations + its backward's temporaries} at the
        moments of its backward where the peak can be (the module doc's list)."""
        s, kept = self.s, self.per_micro_batch()
        out = {"head backward": kept + self._head_backward()} if self.rank.last else {}
        live = kept - self.head + self.recomputed  # the head's tensors are freed by now
        if self.tied:  # the loss's gradient of the tied embedding waits for the lookup's
            live += F32 * s.V * s.h
        stream = s.r * s.Tr * s.h  # the residual stream's gradient
        if self.rank.last:  # and the loss's input gradient, still referenced (measured)
            stream += s.r * s.Tr * s.h
        # Megatron-SP: fc2's reduce-scatter's backward all-gathers that gradient (per chunk
        # when tiled); it lives through fc2's backward, and recomputation runs meanwhile.
        gathered = s.r * s.T * s.h // self.chunks if s.mega_sp else 0
        mlp = 2 * s.e * s.T * s.f // self.chunks + stream + gathered
        if self.chunks > 1:  # one chunk of the MLP recomputed; the chunks' input gradients
            mlp += sum(_mlp_terms(s).values()) // self.chunks + s.r * s.Tr * s.h
        out["mlp backward"] = live + mlp
        freed = sum(v for k, v in self.terms.items() if k.startswith("mlp") or k == "out input")
        core = _core_backward(s)
        if self.recompute == "selective":  # the core's internals again (the ring's and the
            # masked kernel's inputs are the checkpoint's, already kept)
            core += sum(_core_terms(s).values()) - (
                s.e * (s.Q + 2 * s.K) if s.kernel in ("ring", "masked") else 0)
        out["core backward"] = live - freed + stream + core + self.prefetch
        # q, k and v's input gradients summed: two partial sums and the total at once (under
        # tensor parallelism DTensor's accumulation is out of place; else in place, two).
        core_in = sum(v for k, v in self.terms.items() if k.startswith("core"))
        qkv = s.e * s.T * (s.hq + 2 * s.kv) * s.d + (3 if s.tp > 1 else 2) * F32 * s.T * s.h
        out["qkv backward"] = live - freed - core_in + stream + qkv + self.prefetch
        if self.recompute == "full" and (s.sp > 1 or _core_forward(s)):
            # the core's forward working set, or the output all-to-all's packing (the
            # caller's q, k, v before the all-to-all are handed over and freed as sent)
            packing = s.e * s.T * s.hq * s.d if s.sp > 1 else 0
            out["attention recomputed"] = live - self._mlp_of_layer() + stream + max(
                packing, _core_forward(s))
        return out

    def _mlp_of_layer(self) -> int:
        return sum(v for k, v in self.terms.items() if k.startswith("mlp"))

    def _head_backward(self) -> int:
        """The loss's backward on top of everything kept (see the module doc)."""
        s = self.s
        rows = min(s.T, s.ce_rows)
        chunk = 0 if s.ce_kept else F32 * rows * s.V  # recomputed (else counted as kept)
        prev = F32 * min(rows, s.T - rows) * s.V if s.T > rows else 0
        both = (F32 + s.e) / F32 if s.e != F32 else 1  # a chunk in two dtypes at once
        cast = s.e * rows * s.V if s.e != F32 else 0  # dlogits in the matmul dtype
        largest = max(F32 * s.h * s.V + s.e * s.h * rows + chunk + cast,  # a dW product
                      int((prev + chunk) * both),  # the next chunk's exps
                      s.e * s.V * s.h + chunk + cast)  # the final dW
        return F32 * s.h * s.V + s.e * s.T * s.h + 3 * F32 * s.T + largest


def _layer_terms(s: _Shape, selective: bool, chunks: int) -> dict:
    """What one layer keeps for backward, by term (a recomputed layer: while it is)."""
    t = {"attn norm": _norm(s), "attn input": _linear_input(s, 1)}  # q, k, v share one copy
    if s.qk_norm:  # per head: RMSNorm its input (q, k) and rstd; LayerNorm as _norm
        rows = s.T * (s.hq + s.hkv)
        t["qk norms"] = rows * (F32 * (s.d + 2) if s.layernorm else s.e * s.d + F32)
    if selective:
        t["core inputs"] = s.e * s.T * (s.hq + 2 * s.kv) * s.d
    else:
        t.update(_core_terms(s))
    if not _core_out_is_saved(s, selective):
        t["out input"] = s.e * s.T * s.hq * s.d
    if chunks > 1:
        t["mlp (tiled) input"] = s.r * s.Tr * s.h
    else:
        t.update(_mlp_terms(s))
    if s.hidden_dropout:
        t["dropout masks"] = 2 * s.mask_e * s.Tr * s.h
    return t


def _core_out_is_saved(s: _Shape, selective: bool) -> bool:
    """The out-projection's input is the very tensor the core saves (no Ulysses between
    them, no recomputation): SDPA's output; the masked kernel's and the ring's, both saved
    in q's dtype and laid out [b, s, h, d], contiguous, so that the projection's reshape is
    a view."""
    if selective or s.sp > 1:
        return False
    return s.kernel in ("sdpa", "fused", "masked", "ring")


def _norm(s: _Shape) -> int:
    """RMSNorm keeps its input as given (the residual stream) and rstd; LayerNorm the fp32
    input F.layer_norm computes on, mean and rstd."""
    if s.layernorm:
        return F32 * s.Tr * (s.h + 2)
    return s.Tr * (s.r * s.h + F32)


def _linear_input(s: _Shape, linears: int) -> int:
    """The normed input saved by the linears reading it: one fp32 tensor, or under
    autocast each linear's own e-byte copy."""
    return (linears * s.e if s.e != F32 else F32) * s.T * s.h


def _mlp_terms(s: _Shape) -> dict:
    return {"mlp norm": _norm(s), "mlp input": _linear_input(s, 1),  # gate and fc1 share one copy
            "mlp hidden": (4 if s.swiglu else 2) * s.e * s.T * s.f}


def _head_kept(s: _Shape, weight_cast: bool) -> int:
    """Final norm, the loss's input (and autocast's e-byte copy of the weight, where it
    makes one), its per-token statistics, and the one chunk of exps it keeps when
    everything fits in one."""
    out = _norm(s) + s.e * s.T * s.h + 25 * s.T
    if weight_cast:
        out += s.e * s.V * s.h
    if s.ce_kept:
        out += F32 * s.T * s.V
    return out
