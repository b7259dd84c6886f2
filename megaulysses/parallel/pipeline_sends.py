"""Sends of torch's multi-stage pipeline schedules, dropped once their receiver has them.

torch's runtime schedule (`_PipelineScheduleRuntime`: interleaved-1f1b, zero-bubble) keeps
the work of every send it issues, and through the work the tensor sent, in a list that it
waits on only when the step ends: a rank's sent activations and gradients of every
micro-batch. parallel/pipeline.py's stages issue these sends themselves (the same P2POps,
through the same `_batch_p2p`, at the same point of the schedule), hand the schedule no
work, and keep the works here until they can be waited on and dropped.

When: gloo's work cannot say whether a send is done without waiting on it, and waiting on
a send whose receive is not posted yet may deadlock (the receiver may be waiting on us).
Every rank knows the whole schedule (each rank's list of actions, with its sends and
receives), so `drain_plan` replays the step in causal order: a rank's action that waits
on a receive learns everything its sender knew when it sent (a vector clock). A send of
this rank may be waited on from the first action of this rank at which it knows that the
receiver has posted the matching receive: it then completes without the receiver doing
anything more (gloo's and NCCL's transfers progress on their own), so waiting costs no
more than the transfer. Whatever the plan cannot place waits at the step's end, as in
torch. In evaluation the gradient sends and receives are empty: they carry no knowledge.
"""

from __future__ import annotations

from typing import Optional

from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT, FORWARD, FULL_BACKWARD, RECV_B, RECV_F, SEND_B, SEND_F, _Action,
    _batch_p2p)

# The actions at which the stages call `Sends.reached` (parallel/pipeline.py's `_Stage`)
HOOKED = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, SEND_F, SEND_B)


def _key(a: _Action) -> tuple:
    return a.stage_index, a.computation_type, a.microbatch_index


def _flat(actions: list) -> list[_Action]:
    """A rank's actions as the runtime performs them (an overlapped pair one by one)."""
    out: list[_Action] = []
    for a in actions:
        if a is not None:
            out.extend(a.sub_actions or (a,))
    return out


def _message(send: tuple, train: bool) -> Optional[tuple]:
    """A send's message (the send's key): the key of its receive, on the next stage (an
    activation) or the previous one (a gradient; in training only)."""
    t, c, i = send
    if c == SEND_F:
        return t + 1, RECV_F, i
    if c == SEND_B and train:
        return t - 1, RECV_B, i
    return None


def _awaited(a: _Action, train: bool) -> Optional[tuple]:
    """The receive a compute action waits for (if its rank posted one)."""
    t, c, i = _key(a)
    if c == FORWARD:
        return t, RECV_F, i
    if train and c in (FULL_BACKWARD, BACKWARD_INPUT):
        return t, RECV_B, i
    return None


def drain_plan(orders: dict[int, list], me: int, train: bool) -> dict[tuple, list[tuple]]:
    """{action key of rank `me`: the messages it sent that may be waited on there}, from
    every rank's actions with communication (`pipeline_order_with_comms`)."""
    acts = {r: _flat(seq) for r, seq in orders.items()}
    kinds = (RECV_F, RECV_B) if train else (RECV_F,)
    posted = {_key(a): (r, p) for r, seq in acts.items() for p, a in enumerate(seq)
              if a.computation_type in kinds}  # message -> (rank, position) of its receive
    ranks = sorted(acts)
    clock = {r: dict.fromkeys(ranks, -1) for r in ranks}  # what r knows: q ran up to [q]
    at_send: dict = {}  # message -> its sender's clock when it sent
    pos, pending, plan = dict.fromkeys(ranks, 0), [], {}
    while any(pos[r] < len(acts[r]) for r in ranks):
        moved = False
        for r in ranks:
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                need = _awaited(a, train)
                if need in posted and posted[need][0] == r:
                    if need not in at_send:
                        break  # its sender has not sent yet: another rank moves first
                    for q, p in at_send[need].items():
                        clock[r][q] = max(clock[r][q], p)
                clock[r][r] = pos[r]
                message = _message(_key(a), train)
                if message in posted:
                    at_send[message] = dict(clock[r])
                    pending += [message] if r == me else []
                if r == me and a.computation_type in HOOKED:
                    known = clock[r]
                    done = [m for m in pending if known[posted[m][0]] >= posted[m][1]]
                    if done:
                        plan[_key(a)] = done
                        pending = [m for m in pending if m not in done]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the pipeline schedule's sends and receives do not match")
    return plan


class Sends:
    """One rank's sends in the steps of multi-stage schedules (module doc), shared by the
    rank's stages. Outside a step (`begin` .. `end`) it does nothing."""

    def __init__(self) -> None:
        self._plans: dict = {}
        self._plan: Optional[dict] = None
        self._works: dict = {}  # message -> its works, until waited on

    def begin(self, schedule, train: bool) -> None:
        """Before `schedule` runs a step (training or evaluation)."""
        key = (id(schedule), train)
        if key not in self._plans:
            self._plans[key] = drain_plan(schedule.pipeline_order_with_comms,
                                          schedule.rank, train)
        self._plan = self._plans[key]

    def send(self, ops: list, action: tuple) -> list:
        """Issue a send action's ops (the P2POps of one message); returns what the
        schedule should issue itself: nothing during a step, else `ops`."""
        if self._plan is None:
            return ops
        if ops:  # (a gradient send has none in evaluation)
            self._works[_message(action, True)] = _batch_p2p(ops)
        self.reached(action)
        return []

    def reached(self, action: tuple) -> None:
        """This rank is at `action` (stage, kind, micro-batch), its receive waited on:
        wait on and drop the sends whose receives it now knows posted."""
        if self._plan is None:
            return
        for message in self._plan.get(action, ()):
            for work in self._works.pop(message, ()):
                work.wait()

    def end(self) -> None:
        """After the step: wait on what is left (as torch's schedule does at its end)."""
        works, self._works, self._plan = self._works, {}, None
        for pending in works.values():
            for work in pending:
                work.wait()
