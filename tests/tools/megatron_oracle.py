"""Reference ("oracle") megatron-core GPT models and Megatron-LM style checkpoints, on CPU.

Tests use this module to check megaulysses' checkpoint converter against the real thing:
tiny megatron-core ``GPTModel`` s built from ``get_gpt_layer_local_spec`` (no Transformer
Engine, no Apex, no CUDA), run under torch.distributed gloo with tensor and pipeline
parallelism, saved the way Megatron-LM's ``megatron/training/checkpointing.py`` saves
(``torch_dist`` and legacy ``torch`` formats) and loaded back strictly.

Typical use inside a spawned worker::

    init_megatron(rank, world_size, tp, pp, port)
    model = build_model("llama", seed=1234)
    logits = forward_logits(model, tokens)          # [b, s, vocab] on every rank
    save_torch_dist(model, save_dir, 10, megatron_args("llama", {}, tp, pp))

CPU workarounds (each one also commented where it is applied):

* gloo process group; ``initialize_model_parallel(..., create_gloo_process_groups=False)``
  because the default process group already is gloo (the extra gloo groups are redundant).
* RNG: ``model_parallel_cuda_manual_seed`` needs ``torch.cuda.get_rng_state``; instead the
  tracker is initialised with ``initialize_rng_tracker(inference_rng_tracker=True)`` whose
  ``fork()`` is a no-op (dropout is 0, so no RNG stream is ever consumed).
* ``TransformerConfig``: ``use_cpu_initialization=True`` (parameters are allocated on CPU,
  not ``torch.cuda.current_device()``), ``perform_initialization=False`` (every weight is
  overwritten by :func:`randomize_` anyway), fusions off (``gradient_accumulation_fusion``,
  ``bias_dropout_fusion``, ``masked_softmax_fusion``, ``apply_rope_fusion``,
  ``persist_layer_norm``: they need CUDA kernels / Apex / TE) except the bias-GeLU fusion
  (Megatron-LM's default; a torch function, run eagerly: ``torch._dynamo`` is disabled).
* ``perform_initialization=False`` also skips the tensor-parallel marks of the tp layers'
  weights (megatron-core 0.16.1; the optimizer's gradient norm needs them): set after the
  model is built, as later Megatron-LM does.
* Tied embeddings with pp > 1: ``LanguageModule.setup_embeddings_and_output_layer`` does
  ``weight.data.cuda()`` before the first/last stage all-reduce; it is skipped while the model
  is built (patched ``_is_in_embd_group`` -> False); :func:`randomize_` writes the same
  global embedding on both stages instead.
* RoPE: ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``;
  each rotary module gets a ``get_emb`` that keeps it on CPU.
* ``parallel_state``'s GlobalMemoryBuffer (DotProductAttention's baddbmm buffer) allocates on
  ``torch.cuda.current_device()``: replaced by a CPU subclass after initialize_model_parallel.
* Causal mask: with ``attention_mask=None`` the local softmax builds its default causal mask
  with ``device="cuda"``; forward_logits passes an explicit boolean mask instead (no patch).
* torch_dist save: ``FileSystemWriterAsync.preload_tensors`` calls ``torch.cuda.synchronize()``
  and ``save_state_dict_async_finalize`` allocates a flag on ``torch.cuda.current_device()``;
  during ``dist_checkpointing.save`` only, those two become a no-op / ``torch.device("cpu")``.
  The writer also needs ``psutil`` (pip); without it a writer thread dies and the save hangs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.serialization import (
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.random import initialize_rng_tracker
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import GlobalMemoryBuffer
from torch.distributed.checkpoint.api import CheckpointException

STYLES = ("gpt", "llama")

#: Default tiny shapes per style; ``build_model(style, **shape)`` overrides any of them.
DEFAULT_SHAPES: dict[str, dict[str, int]] = {
    "gpt": {
        "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 4,
        "kv_channels": 16, "ffn_hidden_size": 128, "vocab_size": 256, "max_seq_length": 32,
    },
    "llama": {
        "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
        "kv_channels": 16, "ffn_hidden_size": 96, "vocab_size": 256, "max_seq_length": 32,
    },
}

NORM_EPS = 1e-5
ROTARY_BASE = 10000
CHECKPOINT_VERSION = 3.0
DEFAULT_SEED = 1234


# --------------------------------------------------------------------------- init


class _CpuMemoryBuffer(GlobalMemoryBuffer):
    """megatron.core.utils.GlobalMemoryBuffer that allocates on CPU."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # type: ignore[override]
        numel = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(*tensor_shape)


def init_megatron(rank: int, world_size: int, tp: int = 1, pp: int = 1, port: int = 29500) -> None:
    """gloo process group on 127.0.0.1 plus megatron-core's model-parallel groups (CPU only)."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # The default group is gloo already, so the extra gloo copies of the DP groups are not
    # needed (they only cost time and sockets).
    parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
    # GlobalMemoryBuffer allocates on torch.cuda.current_device(); DotProductAttention takes
    # its baddbmm input buffer from it.
    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
    # megatron.core.jit's jit_fuser is torch.compile: its fused functions (bias-GeLU) run
    # as written, eagerly, instead of being compiled on CPU (same math, no C++ build)
    torch._dynamo.config.disable = True
    # model_parallel_cuda_manual_seed() calls torch.cuda.get_rng_state(): unusable on CPU.
    # The inference tracker's fork() is a no-op; with dropout 0 no RNG stream is consumed.
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def destroy_megatron() -> None:
    """Tear down model-parallel groups and the process group."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- model


def model_shape(style: str, **shape: int) -> dict[str, int]:
    """Default shape of ``style`` updated with ``shape``."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    unknown = set(shape) - set(DEFAULT_SHAPES[style]) - {"seed"}
    if unknown:
        raise ValueError(f"unknown shape keys {sorted(unknown)}")
    merged = dict(DEFAULT_SHAPES[style])
    merged.update({k: v for k, v in shape.items() if k != "seed"})
    return merged


def transformer_config(style: str, shape: dict[str, int], gelu_fusion: bool = True,
                       sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                       window_size: tuple[int, int] | None = None) -> TransformerConfig:
    """TransformerConfig of a tiny model for the current parallel layout, CPU friendly.
    `gelu_fusion`: Megatron-LM's --bias-gelu-fusion (its default): the GPT style's GeLU is
    its fused bias-GeLU (tanh approximation), else torch's exact GeLU. `dtype`: the
    parameters' (bf16: Megatron-LM's --bf16 model, softmax in fp32 as its default)."""
    llama = style == "llama"
    return TransformerConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_query_groups"],
        kv_channels=shape["kv_channels"],
        ffn_hidden_size=shape["ffn_hidden_size"],
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        normalization="RMSNorm" if llama else "LayerNorm",
        layernorm_epsilon=NORM_EPS,
        add_bias_linear=not llama,
        add_qkv_bias=not llama,
        gated_linear_unit=llama,
        activation_func=F.silu if llama else F.gelu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        sequence_parallel=sequence_parallel,
        window_size=window_size,  # (left, right); the local softmax builds its mask
        # Allocate parameters on CPU (otherwise torch.cuda.current_device()).
        use_cpu_initialization=True,
        # Every parameter is overwritten by randomize_(); skip megatron's own init.
        perform_initialization=False,
        # Fused kernels need CUDA / Apex / Transformer Engine. The bias-GeLU "fusion" is a
        # torch function (megatron.core.fusions.fused_bias_gelu, compiled by its jit_fuser:
        # torch.compile, which init_megatron turns off so it runs as written).
        gradient_accumulation_fusion=False,
        bias_activation_fusion=gelu_fusion and not llama,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # The local spec: plain PyTorch DotProductAttention.
        attention_backend=AttnBackend.local,
    )


def _cpu_get_emb(self: RotaryEmbedding, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.get_emb without the move of ``inv_freq`` to the current CUDA device."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _keep_rotary_on_cpu(model: torch.nn.Module) -> None:
    # RotaryEmbedding.get_emb() moves inv_freq to torch.cuda.current_device() on first use.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.get_emb = _cpu_get_emb.__get__(module)


@contextlib.contextmanager
def _torch_norms_under_sequence_parallel() -> Iterator[None]:
    """The local spec's norm (WrappedTorchNorm: torch's LayerNorm / RMSNorm) refuses
    sequence_parallel because torch's module does not mark its parameters the way Apex's
    and Transformer Engine's norms do (``sequence_parallel=True``: finalize_model_grads
    all-reduces their gradients over tp). A per-token norm computes the same on a sequence
    slice, so while a model is built the norm is made without the flag, then marked."""
    make = WrappedTorchNorm.__new__

    def marked(cls, config, *args, **kwargs):  # type: ignore[no-untyped-def]
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = make(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    with mock.patch.object(WrappedTorchNorm, "__new__", marked):
        yield


def build_model(style: str, seed: int = DEFAULT_SEED, gelu_fusion: bool = True,
                sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                window_size: tuple[int, int] | None = None, **shape: int) -> GPTModel:
    """This rank's pipeline stage of a tiny ``style`` GPTModel ("gpt" or "llama"), randomized.

    The random weights depend only on ``seed`` and the shape, not on tp/pp: every rank holds
    slices of the same global tensors (see :func:`randomize_`), rounded to ``dtype``.
    """
    shape = model_shape(style, **shape)
    config = transformer_config(style, shape, gelu_fusion, sequence_parallel, dtype,
                                window_size)
    llama = style == "llama"
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    # setup_embeddings_and_output_layer() does weight.data.cuda() before the tied-embedding
    # all-reduce between the first and last stage; skip it, randomize_() writes the same
    # global embedding on both stages.
    with mock.patch.object(LanguageModule, "_is_in_embd_group", lambda self: False), \
            _torch_norms_under_sequence_parallel():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=shape["vocab_size"],
            max_sequence_length=shape["max_seq_length"],
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=not llama,
            position_embedding_type="rope" if llama else "learned_absolute",
            rotary_percent=1.0,
            rotary_base=ROTARY_BASE,
        )
    _keep_rotary_on_cpu(model)
    _mark_tensor_parallel_weights(model)
    model.eval()
    randomize_(model, seed)
    return model


def _mark_tensor_parallel_weights(model: GPTModel) -> None:
    """megatron-core 0.16.1 sets a tp layer weight's ``tensor_model_parallel`` mark only in
    its own initialization, skipped under ``perform_initialization=False``; unmarked, the
    optimizer's gradient norm counts those shards on tp rank 0 only (as replicated
    duplicates). Megatron-LM a72c0278e6 (#4084) marks them either way; so does this."""
    for module in model.modules():
        dim = {VocabParallelEmbedding: 0, ColumnParallelLinear: 0, RowParallelLinear: 1}.get(
            type(module))
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not hasattr(weight, "partition_dim"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


# --------------------------------------------------------------------------- randomization


def _model_sharded_tensors(model: GPTModel) -> Iterator[ShardedTensor]:
    """Every ShardedTensor of the model's sharded_state_dict, factories (SwiGLU fc1) built."""
    def walk(obj: Any) -> Iterator[ShardedTensor]:
        if isinstance(obj, dict):
            for value in obj.values():
                yield from walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                yield from walk(value)
        elif isinstance(obj, ShardedTensor):
            yield obj
        elif isinstance(obj, ShardedTensorFactory):  # SwiGLU fc1: [gate; up] halves
            yield from walk(obj.build())

    yield from walk(model.sharded_state_dict())


def _global_values(key: str, global_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic global tensor for a checkpoint key: norms ~1+0.1N, biases/others ~0.1N."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    noise = torch.randn(global_shape, generator=gen, dtype=torch.float32)
    leaf = key.rsplit(".", 1)[-1]
    if "norm" in key and leaf in ("weight", "layer_norm_weight"):
        return 1.0 + 0.1 * noise
    if "word_embeddings" in key or "position_embeddings" in key or "output_layer" in key:
        return 0.2 * noise
    return 0.1 * noise


def _local_slice(sh: ShardedTensor, full: torch.Tensor) -> torch.Tensor:
    """The part of the global tensor ``full`` that ``sh`` (this rank's shard) covers."""
    assert sh.flattened_range is None, sh.key
    n = sh.prepend_axis_num
    index: list[Any] = list(sh.global_offset[:n])
    index += [slice(o, o + s) for o, s in zip(sh.global_offset[n:], sh.local_shape, strict=True)]
    return full[tuple(index)]


@torch.no_grad()
def randomize_(model: GPTModel, seed: int = DEFAULT_SEED) -> None:
    """Overwrite every parameter with slices of seeded global tensors (layout independent).

    The global tensor of each checkpoint key (as in ``model.sharded_state_dict()``: stacked
    layer axis, TE-style names, SwiGLU fc1 as [gate; up]) is drawn from a generator seeded by
    ``seed`` and the key, then this rank's shard is copied in. Parameters are first set to NaN
    so that one left untouched is detected.
    """
    for p in model.parameters():
        p.fill_(float("nan"))
    for sh in _model_sharded_tensors(model):
        full = _global_values(sh.key, tuple(sh.global_shape), seed)
        sh.data.copy_(_local_slice(sh, full))
    missed = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if missed:
        raise RuntimeError(f"parameters not covered by sharded_state_dict: {missed}")


# --------------------------------------------------------------------------- forward


Models = GPTModel | Sequence[GPTModel]


def _unwrap(model: Models) -> GPTModel:
    """Accept a model or Megatron-LM's list of model chunks (one chunk: no virtual pp)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("virtual pipeline parallelism (several model chunks) is not supported")
        return model[0]
    return model


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Concatenate tensor-parallel vocab shards along the last dim."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _stage_ranks() -> tuple[int, int]:
    """Global ranks of the previous and next pipeline stage (same tp rank)."""
    ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    me = parallel_state.get_pipeline_model_parallel_rank()
    return ranks[max(me - 1, 0)], ranks[min(me + 1, len(ranks) - 1)]


@torch.no_grad()
def forward_logits(model: Models, tokens: torch.Tensor) -> torch.Tensor:
    """Full logits [b, s, vocab] on every rank, pipeline stages run by hand (send/recv).

    Position ids 0..s-1 and an explicit causal mask [1, 1, s, s] (True = masked), as
    Megatron-LM's get_ltor_masks_and_position_ids builds it: with attention_mask=None the
    local DotProductAttention would build its default causal mask with device="cuda".
    Hidden states between stages are [s, b, h].
    """
    model = _unwrap(model)
    model.eval()
    b, s = tokens.shape
    config = model.config
    positions = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s)
    prev_rank, next_rank = _stage_ranks()
    if not parallel_state.is_pipeline_first_stage():
        hidden = torch.empty(s, b, config.hidden_size, dtype=torch.float32)
        dist.recv(hidden, src=prev_rank)
        model.set_input_tensor(hidden)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    out = model(tokens, positions, causal)
    if not parallel_state.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=next_rank)
        logits = torch.empty(b, s, model.vocab_size, dtype=torch.float32)
    else:
        logits = _gather_vocab(out)
    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    dist.broadcast(logits, src=pp_ranks[-1], group=parallel_state.get_pipeline_model_parallel_group())
    return logits


# --------------------------------------------------------------------------- Megatron-LM args


def megatron_args(style: str, shape: dict[str, int] | None = None, tp: int = 1, pp: int = 1,
                  **overrides: Any) -> argparse.Namespace:
    """The fields of Megatron-LM's ``args`` for this model, as pickled into checkpoints."""
    s = model_shape(style, **(shape or {}))
    llama = style == "llama"
    heads, groups = s["num_attention_heads"], s["num_query_groups"]
    args = argparse.Namespace(
        num_layers=s["num_layers"],
        encoder_num_layers=s["num_layers"],
        hidden_size=s["hidden_size"],
        ffn_hidden_size=s["ffn_hidden_size"],
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=s["kv_channels"],
        seq_length=s["max_seq_length"],
        max_position_embeddings=s["max_seq_length"],
        position_embedding_type="rope" if llama else "learned_absolute",
        add_position_embedding=not llama,
        use_rotary_position_embeddings=llama,
        rotary_base=ROTARY_BASE,
        rotary_percent=1.0,
        rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=False,
        normalization="RMSNorm" if llama else "LayerNorm",
        norm_epsilon=NORM_EPS,
        apply_layernorm_1p=False,
        qk_layernorm=False,
        swiglu=llama,
        squared_relu=False,
        add_bias_linear=not llama,
        add_qkv_bias=not llama,
        untie_embeddings_and_output_weights=llama,
        vocab_size=s["vocab_size"],
        padded_vocab_size=s["vocab_size"],
        make_vocab_size_divisible_by=128,
        tokenizer_type="NullTokenizer",
        vocab_file=None,
        merge_file=None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        sequence_parallel=False,
        data_parallel_size=1,
        world_size=tp * pp,
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
        fp8=None,
        num_experts=None,
        moe_router_topk=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        attention_backend=AttnBackend.auto,
        transformer_impl="local",
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        use_distributed_optimizer=False,
        no_save_optim=True,
        no_save_rng=False,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        skipped_train_samples=0,
        micro_batch_size=1,
        global_batch_size=1,
        train_iters=100,
        lr=3e-4,
        min_lr=3e-5,
        lr_decay_style="cosine",
        lr_decay_iters=None,
        lr_warmup_iters=0,
        lr_warmup_fraction=None,
        weight_decay=0.01,
        start_weight_decay=0.01,
        end_weight_decay=0.01,
        weight_decay_incr_style="constant",
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=1.0,
        optimizer="adam",
        seed=DEFAULT_SEED,
        iteration=0,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def opt_param_scheduler_state(args: argparse.Namespace, iteration: int) -> dict[str, Any]:
    """What Megatron-LM's OptimizerParamScheduler.state_dict() returns."""
    return {
        "max_lr": args.lr,
        "lr_warmup_steps": args.lr_warmup_iters * args.global_batch_size,
        "num_steps": iteration * args.global_batch_size,
        "lr_decay_style": args.lr_decay_style,
        "lr_decay_steps": (args.lr_decay_iters or args.train_iters) * args.global_batch_size,
        "min_lr": args.min_lr,
        "start_wd": args.start_weight_decay,
        "end_wd": args.end_weight_decay,
        "wd_incr_style": args.weight_decay_incr_style,
        "wd_incr_steps": args.train_iters * args.global_batch_size,
    }


# --------------------------------------------------------------------------- save


def iteration_dir(save_dir: str, iteration: int) -> str:
    """``<save_dir>/iter_XXXXXXX`` as Megatron-LM's get_checkpoint_name(return_base_dir=True)."""
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def _write_tracker(save_dir: str, iteration: int) -> None:
    """latest_checkpointed_iteration.txt, written by global rank 0 after a barrier."""
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def _rng_state_object() -> ShardedObject:
    """Megatron-LM's get_rng_state(ckpt_format='torch_dist') without the CUDA states."""
    import random

    import numpy as np

    rng = [{
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        # 'cuda_rng_state' (torch.cuda.get_rng_state()) does not exist on CPU.
        "rng_tracker_states": {},
    }]
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return ShardedObject("rng_state", rng, (pp_size, tp_size), (pp_rank, tp_rank),
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def _sharded_sd_metadata() -> dict[str, Any]:
    """Megatron-LM's _build_sharded_state_dict_metadata() without a distributed optimizer."""
    return {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


@contextlib.contextmanager
def sequence_parallel_on_cpu() -> Iterator[None]:
    """Megatron-SP's gathers and reduce-scatters (tensor_parallel.mappings) allocate their
    outputs on torch.cuda.current_device(): a forward and backward under sequence
    parallelism run inside this, which makes it the CPU (gloo moves CPU tensors)."""
    if torch.cuda.is_available():
        yield
        return
    with mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu")):
        yield


def _cuda_to_cpu(make: Any) -> Any:
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return make(*args, **kwargs)
    return on_cpu


def _clip_any_device(clip: Any) -> Any:
    """clip_grad_by_total_norm_fp32 asserts its gradients are torch.cuda.FloatTensor on
    the .grad path; its .decoupled_grad path (same scaling) checks only the dtype."""
    def clip_cpu(parameters: Any, max_norm: float, total_norm: float,
                 use_decoupled_grad: bool = False) -> None:
        params = [p for p in parameters if p.grad is not None]
        for p in params:
            p.decoupled_grad = p.grad
        clip(params, max_norm, total_norm, use_decoupled_grad=True)
        for p in params:
            del p.decoupled_grad
    return clip_cpu


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """megatron-core's DDP wrapper and optimizer (FP32Optimizer, its gradient norm and
    clipping) allocate on CUDA: torch.cuda.current_device() and device="cuda" tensors
    become CPU ones while this is open, and clipping skips its CUDA type check. (The
    local softmax's sliding-window mask, made with device="cuda", too.)"""
    import megatron.core.optimizer.optimizer as optimizer_module
    if torch.cuda.is_available():
        yield
        return
    with mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu")), \
            mock.patch.object(torch, "tensor", _cuda_to_cpu(torch.tensor)), \
            mock.patch.object(torch, "zeros", _cuda_to_cpu(torch.zeros)), \
            mock.patch.object(torch, "empty", _cuda_to_cpu(torch.empty)), \
            mock.patch.object(torch, "ones", _cuda_to_cpu(torch.ones)), \
            mock.patch.object(optimizer_module, "clip_grad_by_total_norm_fp32", _clip_any_device(
                optimizer_module.clip_grad_by_total_norm_fp32)):
        yield


@contextlib.contextmanager
def _cuda_calls_on_cpu() -> Iterator[None]:
    """dist_checkpointing's torch_dist strategy calls CUDA on a CPU-only build; map them to CPU.

    * FileSystemWriterAsync.preload_tensors() ends with torch.cuda.synchronize() (it stages
      GPU tensors with non-blocking copies): nothing to wait for on CPU -> no-op.
    * save_state_dict_async_finalize() all-reduces a failure flag allocated on
      torch.cuda.current_device() -> allocate it on CPU (gloo reduces CPU tensors).
    """
    if torch.cuda.is_available():
        yield
        return
    with mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None), \
            mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu")):
        yield


def save_torch_dist(model: Models, save_dir: str, iteration: int, args: argparse.Namespace,
                    save_rng: bool = True) -> str:
    """Save like Megatron-LM with ``--ckpt-format torch_dist``; all ranks call it. Returns iter dir."""
    model = _unwrap(model)
    ckpt_dir = iteration_dir(save_dir, iteration)
    metadata = _sharded_sd_metadata()
    state_dict: dict[str, Any] = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "model": model.sharded_state_dict(metadata=metadata),
        "opt_param_scheduler": opt_param_scheduler_state(args, iteration),
        "num_floating_point_operations_so_far": 0,
    }
    if save_rng:
        state_dict["rng_state"] = _rng_state_object()
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    content_metadata = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
    with _cuda_calls_on_cpu():
        dist_checkpointing.save(
            state_dict, ckpt_dir, get_default_save_sharded_strategy("torch_dist"),
            content_metadata=content_metadata,
        )
    _write_tracker(save_dir, iteration)
    return ckpt_dir


def legacy_rank_file(ckpt_dir: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """``mp_rank_TT/model_optim_rng.pt`` (pp == 1) or ``mp_rank_TT_PPP/...`` (pp > 1)."""
    sub = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(ckpt_dir, sub, "model_optim_rng.pt")


def _this_rank_file(ckpt_dir: str) -> str:
    return legacy_rank_file(
        ckpt_dir,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def save_legacy_torch(model: Models, save_dir: str, iteration: int, args: argparse.Namespace) -> str:
    """Save like Megatron-LM with ``--ckpt-format torch``; all ranks call it. Returns iter dir."""
    model = _unwrap(model)
    ckpt_dir = iteration_dir(save_dir, iteration)
    if parallel_state.get_data_parallel_rank() == 0:
        state_dict = {
            "args": args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "model": model.state_dict_for_save_checkpoint(),
            "opt_param_scheduler": opt_param_scheduler_state(args, iteration),
            "num_floating_point_operations_so_far": 0,
        }
        path = _this_rank_file(ckpt_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state_dict, path)
    _write_tracker(save_dir, iteration)
    return ckpt_dir


# --------------------------------------------------------------------------- load


#: Sharded keys of a Megatron-LM torch_dist checkpoint that are not part of the model.
NON_MODEL_SHARDED_KEYS = ("rng_state", "optimizer.", "rerun_state_machine")


def load_torch_dist(model: Models, ckpt_dir: str) -> dict[str, Any]:
    """Strictly load a torch_dist checkpoint into ``model``; returns the common state.

    Every model key must be in the checkpoint and every sharded key of the checkpoint must be
    a model key (``StrictHandling.RETURN_ALL`` plus a check), except the non-model objects
    Megatron-LM also saves (rng_state, optimizer.*). Then ``model.load_state_dict(strict=True)``.
    The returned dict holds the common (non-sharded) entries: args, iteration, ...
    Any failure (shape mismatch, missing/extra keys) raises RuntimeError on every rank.
    """
    model = _unwrap(model)
    sharded = {"model": model.sharded_state_dict(metadata=_sharded_sd_metadata())}
    # megatron-core's naming: "missing" = in the checkpoint, not requested;
    # "unexpected" = requested, not in the checkpoint.
    try:
        loaded, in_ckpt_only, requested_only = dist_checkpointing.load(
            sharded, ckpt_dir, strict=StrictHandling.RETURN_ALL)
    except CheckpointException as exc:
        # torch DCP's CheckpointException derives from BaseException, not Exception.
        raise RuntimeError(f"{ckpt_dir}: torch_dist load failed: {exc}") from exc
    in_ckpt_only = {k for k in in_ckpt_only if not k.startswith(NON_MODEL_SHARDED_KEYS)}
    if in_ckpt_only or requested_only:
        raise RuntimeError(f"{ckpt_dir}: model keys absent from the checkpoint "
                           f"{sorted(requested_only)}; checkpoint keys the model does not have "
                           f"{sorted(in_ckpt_only)}")
    model.load_state_dict(loaded["model"], strict=True)
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    return {k: v for k, v in common.items() if k != "model"}


def load_legacy_torch(model: Models, ckpt_dir: str) -> dict[str, Any]:
    """Load this rank's ``mp_rank_*`` file of a legacy checkpoint (strict); returns the rest."""
    model = _unwrap(model)
    state = torch.load(_this_rank_file(ckpt_dir), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"], strict=True)
    return {k: v for k, v in state.items() if k != "model"}


# --------------------------------------------------------------------------- self-check


def _self_check_worker(rank: int, world_size: int, tp: int, pp: int, port: int,
                       out_dir: str) -> None:
    torch.set_num_threads(1)
    init_megatron(rank, world_size, tp, pp, port)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    results: dict[str, torch.Tensor] = {}
    for style in STYLES:
        model = build_model(style)
        logits = forward_logits(model, tokens)
        args = megatron_args(style, None, tp, pp)
        base = os.path.join(out_dir, f"{style}_tp{tp}_pp{pp}")
        td_dir = save_torch_dist(model, os.path.join(base, "torch_dist"), 7, args)
        lg_dir = save_legacy_torch(model, os.path.join(base, "torch"), 7, args)
        fresh = build_model(style, seed=99)
        common = load_torch_dist(fresh, td_dir)
        assert common["iteration"] == 7 and common["args"].num_layers == args.num_layers
        td_logits = forward_logits(fresh, tokens)
        fresh = build_model(style, seed=98)
        load_legacy_torch(fresh, lg_dir)
        lg_logits = forward_logits(fresh, tokens)
        torch.testing.assert_close(td_logits, logits, rtol=0, atol=0)
        torch.testing.assert_close(lg_logits, logits, rtol=0, atol=0)
        results[style] = logits
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"logits_tp{tp}_pp{pp}.pt"))
    destroy_megatron()


def _spawn(world_size: int, tp: int, pp: int, port: int, out_dir: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_self_check_worker, args=(world_size, tp, pp, port, out_dir), nprocs=world_size)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for init_megatron."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_self_check(out_dir: str) -> None:
    """tp1 / tp2 / pp2 for both styles: logits agree, both formats round-trip."""
    start = time.time()
    layouts = [(1, 1), (2, 1), (1, 2)]
    for tp, pp in layouts:
        t0 = time.time()
        _spawn(tp * pp, tp, pp, free_port(), out_dir)
        print(f"tp{tp} pp{pp}: gpt+llama forward, torch_dist and torch save -> load -> same "
              f"logits ok ({time.time() - t0:.1f}s)", flush=True)
    ref = torch.load(os.path.join(out_dir, "logits_tp1_pp1.pt"))
    for tp, pp in layouts[1:]:
        other = torch.load(os.path.join(out_dir, f"logits_tp{tp}_pp{pp}.pt"))
        for style in STYLES:
            diff = (other[style] - ref[style]).abs().max().item()
            scale = ref[style].abs().max().item()
            assert diff < 1e-5, (style, tp, pp, diff)
            print(f"{style}: tp{tp} pp{pp} logits == tp1 pp1 (max diff {diff:.2e}, "
                  f"max |logit| {scale:.2f})", flush=True)
    print(f"megatron_oracle self-check passed in {time.time() - start:.1f}s", flush=True)


def main(argv: list[str]) -> int:
    """``python megatron_oracle.py [KEEP_DIR]``: self-check; checkpoints kept in KEEP_DIR."""
    import tempfile

    if argv:
        os.makedirs(argv[0], exist_ok=True)
        run_self_check(argv[0])
    else:
        with tempfile.TemporaryDirectory(prefix="megatron_oracle_") as out_dir:
            run_self_check(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
