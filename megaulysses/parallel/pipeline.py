"""Pipeline parallelism: the GPT cut into stages by layers, run by torch.distributed.pipelining.

Stage s of S = pp * v holds the layers `config.pipeline_layout` gives it; the first stage
also the embedding, the last the final norm, the output layer and the loss. Stage s runs on
pipeline rank s % pp, so with v virtual stages rank r holds stages r, r + pp, ... (the loop
order the interleaved schedules expect). Each rank builds one GPT holding only its parts
(`keep_stages`, applied on the meta device): parameter names never change, so initial
values and checkpoints are the same on every grid. The schedule runs `StageModule`s,
views over that model's parts.

What crosses a stage boundary: the hidden states of one micro-batch, `[b, s/sp, h]`
(Ulysses: this rank's sequence slice) or `[b, s/(sp*tp), h]` under Megatron-SP, fp32, as
plain tensors (tp ranks hold equal copies, or their own sequence shard); their gradients
go back. Tokens, positions, labels and loss masks are known on every rank (every rank
reads the batch), so each stage gets them as keyword arguments instead of over the wire.

Tied embeddings: the last stage keeps its own copy of `embed.word.weight` (same name,
same initial value). After backward the gradients of the two copies are summed between
the first and the last stage (`Comm.pair_sum`: both get a + b, bitwise equal), so the
copies stay identical; the norm counts the first stage's copy only.

Receive buffers: torch's stage allocates an activation and a gradient receive buffer per
micro-batch of the step when a schedule first runs, and keeps them all (1536 micro-batches:
1536 of each, where 1F1B has at most pp in flight). `_Stage` allocates a micro-batch's
buffer when its receive is posted and lets it go once the micro-batch's backward is done
(in evaluation: its forward), so a rank holds only the buffers of the micro-batches in
flight. The received activation is the stage input kept for backward anyway; the last
stage detaches each loss after its backward, since the schedule keeps the losses (and
through their graphs the stage inputs) until the step ends. Sends: torch's multi-stage
schedules (interleaved-1f1b, zero-bubble) would keep every send's work, and the tensor it
sent, until the step ends; there the stages issue their sends themselves and drop each
once its receiver has posted the receive (parallel/pipeline_sends.py).

Loss: the last stage's loss function sums each micro-batch's token losses under the loss
mask and scales the sum by that micro-batch's factor (loss scale x its weight,
training/loss_weights.py), the same contract as without pipeline; the schedule does not
rescale gradients (`scale_grads=False`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.stage import _RecvInfo

from megaulysses.parallel.comm import Comm
from megaulysses.parallel.dims import DP, PP, SP, TP
from megaulysses.parallel.pipeline_sends import (BACKWARD_INPUT, FORWARD, FULL_BACKWARD,
                                                 SEND_B, SEND_F, Sends)

if TYPE_CHECKING:
    from megaulysses.model.gpt import GPT

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble}
SINGLE_STAGE = ("gpipe", "1f1b")  # these take one stage; the others a list of stages


def local_stages(num_stages: int, pp: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` runs: pp_rank, pp_rank + pp, ..."""
    return list(range(pp_rank, num_stages, pp))


def keep_stages(model: GPT, layout: list[list[int]], stages: list[int]) -> GPT:
    """Drop (on meta) every part of `model` that none of `stages` uses."""
    owned = {str(i) for s in stages for i in layout[s]}
    for name in [n for n in model.layers if n not in owned]:
        del model.layers[name]
    first, last = 0 in stages, len(layout) - 1 in stages
    tied = not model.cfg.untie_embeddings_and_output_weights
    # Parts dropped in place: the GPT checks them for None (its attributes are typed whole)
    if not first:
        if last and tied:
            model.embed.position = None  # the last stage keeps the word embedding only
        else:
            model.embed = None  # type: ignore[assignment]
    if not last:
        model.head = None  # type: ignore[assignment]
    return model


class StageModule(nn.Module):
    """One pipeline stage: a view over the parts of this rank's GPT that the stage uses."""

    gpt: GPT  # in __dict__, set in __init__: not a submodule

    def __init__(self, model: GPT, layer_ids: list[int], first: bool, last: bool,
                 residual: torch.dtype):
        super().__init__()
        self.first, self.last, self.residual = first, last, residual
        tied_last = last and not model.cfg.untie_embeddings_and_output_weights
        self.embed = model.embed if first or tied_last else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.head = model.head if last else None
        self.__dict__["gpt"] = model  # not a submodule: parameters() is this stage's only

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x: tokens [b, s/sp] on the first stage, else hidden [b, s/sp, h]; documents [b, S]
        if self.first:
            assert self.embed is not None, "the first stage holds the embedding"
            x = self.embed(x, position_ids)
        x = self.gpt.run_layers(x, position_ids, self.layers.values(), documents)  # [b, s/sp, h]
        if self.last:
            return self.gpt.output(x, labels)  # losses [b, s/sp]
        if x.dtype != self.residual:  # the next stage reads these bytes as `residual`
            raise RuntimeError(f"the pipeline stage of layers {list(self.layers)} sends "
                               f"{x.dtype} hidden states; stages exchange {self.residual}")
        return x


def _unbuffered(infos: tuple) -> tuple:
    """Copies of a micro-batch's receive infos without their buffers."""
    return tuple(_RecvInfo(i.input_name, i.source, None, i.tensor_meta,
                           is_root_arg=i.is_root_arg) for i in infos)


def _allocate(infos: tuple, device) -> None:
    """Give each receive of a micro-batch a fresh buffer (its shape from the metadata)."""
    for info in infos:
        if not info.is_root_arg and info.tensor_meta is not None and info.buffer is None:
            info.buffer = _make_tensor_from_meta(info.tensor_meta, device)


def _release(infos: tuple) -> None:
    """Drop the receive infos' references to their buffers: whoever still needs one
    (autograd, zero-bubble's pending weight pass) holds its own."""
    for info in infos:
        if not info.is_root_arg:
            info.buffer = None


def _cut_graph(losses) -> None:
    """Detach a micro-batch's loss once its backward is done. The schedule keeps every
    loss until the step ends, and through its graph the nodes that hold the stage's
    input: the received activation buffer, one per micro-batch."""
    for loss in losses:
        if isinstance(loss, torch.Tensor) and not loss._is_view():
            loss.detach_()


class _Stage(PipelineStage):
    """PipelineStage whose sends are counted in the Comm's byte ledger and whose forward
    and backward chunks are timed in its timers (when on), with a hook that runs before
    the last micro-batch's backward (to start the dp x sp gradient reduction while that
    backward runs), whose receive buffers exist only while their micro-batch is in
    flight, and whose sends under the multi-stage schedules go through `sends` (module
    doc)."""

    def __init__(self, *args, comm: Comm, sends: Sends, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm, self.sends = comm, sends  # sends: the rank's, shared by its stages
        self.before_last_backward = None
        self.after_weight_grads = None  # takes the weight gradients a W pass assigned

    def _setup_forward_recv_info(self, num_microbatches, has_backward):
        # torch allocates a buffer per micro-batch here: let it make micro-batch 0's infos
        # (one buffer, dropped at once) and give every micro-batch bufferless copies.
        super()._setup_forward_recv_info(1, has_backward)
        template = self.args_recv_info[0]
        for i in range(num_microbatches):
            self.args_recv_info[i] = _unbuffered(template)

    def _create_grad_recv_info(self, act_send_info):
        return _unbuffered(super()._create_grad_recv_info(act_send_info))

    def get_fwd_recv_ops(self, fwd_chunk_id):
        _allocate(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        if self.has_backward and not self.is_last:
            _allocate(self.grad_recv_info[bwd_chunk_id], self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.comm.count_p2p(ops, PP)
        if not self.has_backward:  # evaluation: the ops hold the output until it is sent
            self.fwd_cache.pop(fwd_chunk_id, None)
        return self.sends.send(ops, (self.stage_index, SEND_F, fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.comm.count_p2p(ops, PP)
        return self.sends.send(ops, (self.stage_index, SEND_B, bwd_chunk_id))

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        # its receive is in: sends it proves arrived are dropped before the chunk allocates
        self.sends.reached((self.stage_index, FORWARD, fwd_chunk_id))
        with self.comm.stats.timers("forward", self.device.type):
            output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not self.has_backward:
            # evaluation: no backward will pop the cached input and output; the input is
            # done with, the output waits for its send (get_fwd_send_ops), the last
            # stage's for none (single-stage schedules still ask it for send ops)
            _release(self.args_recv_info[fwd_chunk_id])
            sent, _ = self.fwd_cache[fwd_chunk_id]
            self.fwd_cache[fwd_chunk_id] = (() if self.is_last else sent, [])
        return output

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                           last_backward=False):
        kind = FULL_BACKWARD if full_backward else BACKWARD_INPUT  # as forward_one_chunk
        self.sends.reached((self.stage_index, kind, bwd_chunk_id))
        # torch's schedules call this in evaluation too (it returns at once there): the
        # hook must not fire then, or the next step would reduce its first micro-batch only.
        if (last_backward and full_backward and self.has_backward
                and self.before_last_backward is not None):
            self.before_last_backward()
        with self.comm.stats.timers("backward", self.device.type):
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
        if not self.has_backward:
            return
        _release(self.args_recv_info[bwd_chunk_id])  # the micro-batch's receives are
        _release(self.grad_recv_info.get(bwd_chunk_id, ()))  # consumed
        if full_backward and loss is not None:
            _cut_graph((loss,))

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        # zero-bubble's weight gradients; its input-gradient pass kept the loss for this
        state = self.backward_state.get(bwd_chunk_id)
        with self.comm.stats.timers("backward", self.device.type):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        if self.after_weight_grads is not None:
            self.after_weight_grads()
        if self.is_last and state is not None:
            _cut_graph(state[2])  # the stage output: the loss on the last stage


def stage_modules(model: GPT, layout: list[list[int]], stage_ids: list[int],
                  residual: torch.dtype) -> list[StageModule]:
    """This rank's stages as modules (views over `model`), before anything is materialized:
    under ZeRO-2/3 each is an FSDP root, sharded while still on the meta device.
    `residual`: the residual stream's dtype, which the stages exchange."""
    last = len(layout) - 1
    return [StageModule(model, layout[s], s == 0, s == last, residual) for s in stage_ids]


class Pipeline:
    """This rank's stages and the schedule that runs them over the micro-batches of a step.

    `modules`: `stage_modules(model, layout, local_stages(...))`, materialized.
    `micro_shape`: (micro-batch size, local tokens per sample = seq / sp, local tokens
    between blocks = seq / sp, or seq / (sp * tp) under Megatron-SP, hidden size, the
    residual stream's dtype).
    """

    def __init__(self, model: GPT, comm: Comm, layout: list[list[int]], schedule: str,
                 n_micro: int, micro_shape: tuple, device: torch.device, modules: list):
        pp, rank = comm.size(PP), comm.rank(PP)
        self.model, self.comm, self.n_micro, self.schedule_name = model, comm, n_micro, schedule
        self.stage_ids = local_stages(len(layout), pp, rank)
        self.sends = Sends()  # used by the multi-stage schedules only (`_run`)
        self.stages = [self._stage(module, s, len(layout), micro_shape, device)
                       for module, s in zip(modules, self.stage_ids, strict=True)]
        self._schedules: dict = {}
        self._schedule_for(n_micro)  # the full-size one now: torch refuses a count at build
        self.has_first, self.has_last = 0 in self.stage_ids, len(layout) - 1 in self.stage_ids
        tied = not model.cfg.untie_embeddings_and_output_weights
        self.tied_peer = None  # the tied pair: pipeline rank 0 (stage 0) and rank pp - 1
        if tied and self.has_first:
            self.tied_peer = pp - 1
        elif tied and self.has_last:
            self.tied_peer = 0
        self.norm_excluded = ([model.embed.word.weight] if tied and self.has_last
                              and not self.has_first else [])
        self._sums: list = []
        self._grad_scales: list[float] = []

    def _stage(self, module, s: int, num_stages: int, micro_shape: tuple, device):
        b, s_tok, s_hid, h, residual = micro_shape
        first, last = s == 0, s == num_stages - 1
        # Shapes given up front ("static" stages): no shape-inference pass at the first step.
        hidden = dict(device="meta", requires_grad=True, dtype=residual)  # gradients travel back
        inputs = (torch.empty(b, s_tok, dtype=torch.long, device="meta") if first
                  else torch.empty(b, s_hid, h, **hidden))
        outputs = (torch.empty(b, s_tok, device="meta", requires_grad=True) if last  # fp32 losses
                   else torch.empty(b, s_hid, h, **hidden))
        return _Stage(module, s, num_stages, device, input_args=inputs, output_args=outputs,
                      group=self.comm.group(PP), comm=self.comm, sends=self.sends)

    def _schedule_for(self, n_micro: int):
        """The schedule of a step of `n_micro` micro-batches, built at its first use: a
        --rampup-batch-size run steps with several counts (evaluation with the full one).
        The schedules share the stages; each prepares their receive infos (buffers come
        per micro-batch in flight) for its count when first run, and the counts a later
        one uses were prepared alike."""
        if n_micro not in self._schedules:
            stages = self.stages[0] if self.schedule_name in SINGLE_STAGE else self.stages
            self._schedules[n_micro] = SCHEDULES[self.schedule_name](
                stages, n_micro, loss_fn=self._loss, scale_grads=False)
        return self._schedules[n_micro]

    def _loss(self, losses, mask):  # per-token losses [b, s/sp] fp32, loss mask [b, s/sp]
        # The last stage computes the micro-batches' losses in order: the i-th call is
        # micro-batch i.
        micro = (losses * mask).sum()
        scale = self._grad_scales[len(self._sums)]
        self._sums.append(micro.detach())
        return micro * scale

    def _run(self, batches: list[dict], train: bool) -> float:
        # The schedule cuts these [n*b, s/sp] tensors back into the n micro-batches.
        cat = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        inputs = dict(target=cat["loss_mask"], position_ids=cat["position_ids"],
                      labels=cat["labels"])
        if "documents" in cat:  # whole-sample document ids [n*b, S], cut like the rest
            inputs["documents"] = cat["documents"]
        self._sums = []
        schedule = self._schedule_for(len(batches))
        if self.schedule_name not in SINGLE_STAGE:
            self.sends.begin(schedule, train)
        if train:
            # timers on: the schedule's time outside the stages' forward and backward
            # (sends, receives, waiting for the other stages) is the step's p2p time
            with self.comm.stats.timers.remainder("p2p", ("forward", "backward"),
                                                  cat["tokens"].device.type):
                schedule.step(cat["tokens"], return_outputs=False, **inputs)
        else:
            schedule.eval(cat["tokens"], return_outputs=False, **inputs)  # losses via _loss
        self.sends.end()
        total = torch.zeros(())
        for micro in self._sums:  # in micro-batch order, as the one-process loop adds them
            total += micro.float().cpu()
        return float(total)

    def step(self, batches: list[dict], grad_scales: list[float]) -> float:
        """Forward and backward of every micro-batch; returns this rank's masked loss sum
        (non-zero on the last stage only). Gradients are those of
        sum_i(micro-batch i's sum * grad_scales[i])."""
        self._grad_scales = list(grad_scales)
        return self._run(batches, train=True)

    def evaluate(self, batches: list[dict]) -> float:
        """Forward only; this rank's masked loss sum (non-zero on the last stage only)."""
        self._grad_scales = [1.0] * len(batches)
        return self._run(batches, train=False)

    def overlap_grad_reduction(self, arm: Callable[[], None]) -> None:
        """Call `arm` (GradReducer.arm) before the last backward of a step, so the gradient
        reduction overlaps it. Only with one stage per rank and whole backwards (1f1b,
        gpipe): otherwise a parameter's gradient is not final after "its" last backward,
        and the reduction runs after the schedule instead."""
        if self.schedule_name in SINGLE_STAGE:
            self.stages[0].before_last_backward = arm

    def after_weight_grads(self, take: Callable[[], None]) -> None:
        """Call `take` after every zero-bubble weight pass: torch assigns those gradients
        (no autograd hook sees them), so an optimizer that accumulates them elsewhere
        (dist_opt) takes each micro-batch's at once."""
        for stage in self.stages:
            stage.after_weight_grads = take

    def sync_tied_grads(self, grad_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the tied embedding's gradients of the first and last stage (see module doc).
        `grad_of(param)`: the tensor holding this rank's reduced gradient (whole, or its
        ZeRO rows: both stages cut the embedding alike)."""
        if self.tied_peer is None:
            return
        self.comm.pair_sum(grad_of(self.model.embed.word.weight), PP, self.tied_peer)


def full_state_dict(model: nn.Module, comm: Comm) -> Optional[dict[str, torch.Tensor]]:
    """The whole model's state dict on global rank 0 (None elsewhere), from any grid:
    tensor-parallel shards gathered (every rank takes part), pipeline stages collected
    from the stages' first (dp = sp = tp = 0) ranks. Costs a full copy on rank 0."""
    lead = all(comm.rank(d) == 0 for d in (DP, SP, TP))
    state = {}
    for name, t in model.state_dict().items():
        whole = t.full_tensor() if isinstance(t, DTensor) else t  # a collective over tp
        if lead:
            state[name] = whole.detach().cpu()
    if not lead:
        return None
    parts = comm.gather_object(state, PP)  # stage order; the tied copy twice, equal
    if parts is None:
        return None
    return {k: v for part in parts for k, v in part.items()}
