"""LiveBytes: exact live tensor bytes on simple cases, autograd, checkpointing, fake tensors,
and on 2 gloo ranks (c10d and functional collectives, DTensor, FSDP2)."""

import gc
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from dist import run_ranks
from helpers import LLAMA, with_vocab
from megaulysses.training import live_bytes
from megaulysses.training.live_bytes import LiveBytes, storage_bytes

F32 = 4


def test_allocation_views_inplace_free_and_peak():
    pre = torch.zeros(100)  # before the tracker: not counted, even when written in place
    with LiveBytes() as mem:
        a = torch.empty(1000)
        assert mem.current == mem.peak == 1000 * F32
        b, c = a.view(10, 100), a[:5]  # views share the storage
        a.add_(1)
        pre.add_(1)
        pre.view(10, 10).mul_(2)
        torch.add(a[:100], 1, out=pre)  # out= into an untracked storage
        assert mem.current == 1000 * F32
        d = torch.ones(250)
        assert mem.current == mem.peak == 1250 * F32
        del a, b
        assert mem.current == 1250 * F32  # c still holds the storage
        del c
        assert mem.current == 250 * F32 and mem.peak == 1250 * F32
        mem.reset_peak()
        assert mem.peak == 250 * F32
        e = torch.empty(0)
        e.resize_(50)  # a tracked storage that grows
        assert mem.current == 300 * F32
        e.untyped_storage().resize_(0)  # FSDP's way to free (not dispatched)
        assert mem.current == 250 * F32
        e.untyped_storage().resize_(40)
        assert mem.current == 260 * F32
        del d, e
        assert mem.current == 0 and mem.storages == 0
    assert torch.UntypedStorage.resize_ is live_bytes._ORIGINAL_RESIZE  # unpatched on exit


def test_tensor_held_only_by_autograd_stays_counted_until_backward():
    w = torch.randn(8, requires_grad=True)
    with LiveBytes() as mem:
        x = torch.randn(1000, 8)
        y = (x * w).sum()  # mul saves x for w's gradient
        del x
        gc.collect()
        assert mem.current == 1000 * 8 * F32 + F32  # x (saved by autograd) + y
        y.backward()  # frees the saved x; allocates w.grad on this thread
        assert mem.current == F32 + 8 * F32  # y + w.grad
        assert w.grad is not None


def test_mlp_forward_backward_peak_matches_hand_count():
    B, h, f = 16, 8, 32
    w1 = torch.randn(h, f, requires_grad=True)
    w2 = torch.randn(f, h, requires_grad=True)
    with LiveBytes() as mem:
        with mem.phase("forward"):
            x = torch.randn(B, h)
            r = torch.relu(x @ w1)  # x @ w1 is freed after relu (relu saves its output)
            o = r @ w2
        # forward peak inside relu: x, x @ w1, r; afterwards x, r (saved), o
        assert mem.current == (2 * B * h + B * f) * F32
        assert mem.peak == (B * h + 2 * B * f) * F32
        del x, r
        with mem.phase("backward"):
            g = torch.ones(B, h)
            o.backward(g)
        # peak in ReluBackward: x, r, o, g, dL/dw2 [f, h], dL/dr, dL/d(x @ w1)
        assert mem.peak == (3 * B * h + 3 * B * f + f * h) * F32
        assert mem.peak_by_label == {"forward": (2 * B * h + B * f) * F32,
                                     "backward": (B * h + 2 * B * f + f * h) * F32}
        # left: o, g and the two gradients
        assert mem.current == (2 * B * h + 2 * f * h) * F32
        assert mem.current_by_label["backward"] == (B * h + 2 * f * h) * F32

        # the same under non-reentrant checkpointing: forward keeps only x and o; backward
        # recomputes (on this thread, counted) and peaks as high as without it
        w1.grad = w2.grad = None
        del o, g
        mem.reset_peak()
        base = mem.current
        x = torch.randn(B, h)
        o = checkpoint(lambda t: torch.relu(t @ w1) @ w2, x, use_reentrant=False)
        assert mem.current - base == 2 * B * h * F32
        o.backward(torch.ones(B, h))
        assert mem.peak - base == (3 * B * h + 3 * B * f + f * h) * F32


def test_fake_and_meta_tensors_counted_without_memory():
    with FakeTensorMode() as fake:
        with LiveBytes() as mem:
            a = torch.empty(2 ** 30)  # 4 GiB that never exist
            b = a.view(-1, 2)
            assert mem.current == 2 ** 32
            with fake:  # the active fake mode entered again (DTensor's sharding
                torch.empty(10)  # propagation does this): shape arithmetic, not counted
            del a, b
            m = torch.empty(3, device="meta")
            assert mem.current == 3 * F32 and mem.peak == 2 ** 32
            del m


def _allocator_high_water(fn) -> int:
    """The CPU allocator's most bytes in use while `fn` ran, above its level when `fn`
    began (the torch profiler's memory events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo.extend(event.children)
        if event.tag == _EventType.Allocation:
            f = event.extra_fields
            events.append((event.start_time_ns, f.total_allocated, f.alloc_size))
    events.sort()
    base = events[0][1] - events[0][2]  # the level before the first allocation
    return max(total for _, total, _ in events) - base


def test_gpt_step_peak_matches_the_allocators_high_water_mark():
    """A whole training step of a tiny GPT (fused loss and attention, AdamW): LiveBytes'
    peak is the CPU allocator's high-water mark, less what lives inside one kernel call
    (oneDNN's scratchpads, a kernel's own temporaries, wrapped Python scalars) and is no
    tensor: below 5% here, at a tiny size where they weigh most."""
    from megaulysses.config import parse_args
    from megaulysses.model.attention import cpu_attention
    from megaulysses.model.gpt import build_model
    cfg = parse_args(LLAMA + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "64", "--vocab-size", "500", "--tokenizer-type",
                      "NullTokenizer"])
    cfg = with_vocab(cfg, 501)  # the NullTokenizer's (vocab + EOD), as the trainer sets it
    model = build_model(cfg.model, cpu_attention, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 500, (2, 65))

    def step():
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's states exist from here on, as in a running job
    gc.collect()
    with LiveBytes() as mem:
        step()
    assert mem.current == 0  # everything the step allocated is gone again
    high_water = _allocator_high_water(step)
    assert mem.peak <= high_water <= 1.05 * mem.peak, (mem.peak, high_water)


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    assert storage_bytes([a, a[:3], a.view(2, 5), None, torch.zeros(2)]) == 12 * F32


def _settled(mem, expected, seconds=2.0):
    """mem.current once it equals `expected` (or after `seconds`): gloo's worker thread
    may drop its reference to a finished collective's buffers just after wait() returns,
    and they are live until then."""
    deadline = time.monotonic() + seconds
    while mem.current != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return mem.current


def _ranks(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    pre = torch.ones(1000)
    with LiveBytes() as mem:
        dist.all_reduce(pre)  # in place on a storage from before: nothing new
        out["all_reduce"] = mem.current
        buf = torch.empty(world * 1000)  # c10d's output buffer
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(buf, pre)
        out["all_gather"] = mem.current
        del buf
        _settled(mem, 0)  # gloo's worker thread may still hold buf for a moment
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        y = funcol.wait_tensor(gather(pre, 0, mesh))  # allocated in C++
        out["functional"] = _settled(mem, world * 1000 * F32)
        del y
    d = distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)])  # [32, 32] per rank
    with LiveBytes() as mem:
        r = d.redistribute(mesh, [Replicate()])  # DTensor: its local [64, 32] counted
        out["dtensor"] = mem.current
        del r
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False),
                                torch.nn.Linear(64, 64, bias=False))
    for layer in model:
        fully_shard(layer, mesh=mesh)  # gathered before forward, freed after (resize_)
    fully_shard(model, mesh=mesh)  # the root (no parameters of its own)
    x = torch.randn(4, 64)
    out["shards"] = storage_bytes(model.parameters())
    for step in range(2):  # step 2: FSDP re-allocates its buffers with resize_
        with LiveBytes() as mem:
            loss = model(x).sum()
            expected = (4 * 64 + 1) * F32  # the first layer's output (saved), the loss
            out[f"forward{step}"] = (_settled(mem, expected), mem.peak)
            loss.backward()
            expected = F32 + 2 * 64 * 64 * F32 // world  # the loss, the gradient shards
            out[f"backward{step}"] = _settled(mem, expected)
            del loss
        model.zero_grad()
    return out


def test_two_gloo_ranks_collectives_dtensor_fsdp():
    for out in run_ranks(_ranks, 2, timeout=120):
        assert out["all_reduce"] == 0
        assert out["all_gather"] == 2 * 1000 * F32
        assert out["functional"] == 2 * 1000 * F32
        assert out["dtensor"] == 64 * 32 * F32
        full = 64 * 64 * F32  # one layer's whole weight
        assert out["shards"] == 2 * full // 2
        for step in range(2):
            current, peak = out[f"forward{step}"]
            assert current == (4 * 64 + 1) * F32
            assert peak >= full  # a gathered weight, its all-gather buffer
            assert out[f"backward{step}"] == F32 + 2 * full // 2
        # step 2 re-allocates FSDP's buffers with resize_ and the tracker still sees
        # them; the peaks may differ by one [4, 64] activation: whether autograd or
        # gloo's worker thread lets go of one a moment before the next all-gather
        # lands (CI saw 51200 vs 50176 bytes once)
        (_, peak0), (_, peak1) = out["forward0"], out["forward1"]
        assert abs(peak0 - peak1) <= 4 * 64 * F32, (peak0, peak1)
