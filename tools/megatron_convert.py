"""convert_checkpoint.py's Megatron-LM directions: from-megatron and to-megatron (the
formats and layouts are megaulysses/training/megatron's; this is the command line)."""

from __future__ import annotations

import argparse
import os
import shlex

from megaulysses.config import positive_int

from convert_outputs import check_target, staged
from hf_errors import ConvertError, warn

FORMATS = ("torch_dist", "torch")
IMPLS = ("transformer_engine", "local")


def _exists(path: str, flag: str) -> None:
    if not os.path.exists(path):  # before importing torch: a typo answers at once
        raise ConvertError(flag, f"{path} does not exist")


def read_any(load: str) -> tuple[dict, dict, str]:
    """(meta, whole-model state, checkpoint directory) of our checkpoint or a Megatron-LM
    one (read and converted in memory: to-hf and to-megatron take either)."""
    _exists(load, "--load")
    from megaulysses.training.megatron import is_megatron, read_megatron
    from megaulysses.training.megatron.convert import RUN_SETTINGS, imported_meta
    if not is_megatron(load):
        from megaulysses.training.checkpoint import find_checkpoint, read_model_checkpoint
        path = find_checkpoint(load)
        assert path is not None  # without --save to resume into, it finds one or raises
        meta, state = read_model_checkpoint(path)
        return meta, state, path
    ckpt = read_megatron(load)
    meta = imported_meta(ckpt)  # + the run's settings where to-hf reads a run's
    meta.update(model=ckpt.cfg.shape_dict(), args={"model": {
        k: meta["converted_from"][k] for k in RUN_SETTINGS}})
    return meta, ckpt.state, ckpt.path


def continue_flags(cfg, trainer_flags) -> list[str]:
    """pretrain_gpt.py's model flags for an imported Megatron-LM model (its dropout kept)."""
    flags = trainer_flags(cfg, cfg.window_size)  # its window, where it had one
    at = flags.index("--hidden-dropout")
    flags[at:at + 4] = ["--hidden-dropout", repr(cfg.hidden_dropout), "--attention-dropout",
                        repr(cfg.attention_dropout)]
    return flags


def from_megatron(args: argparse.Namespace, trainer_flags) -> str:
    from megaulysses.training.megatron import import_megatron, not_carried
    check_target(args.save, "--save", args.force)
    _exists(args.load, "--load")
    with staged(args.save) as out:
        ckpt, _ = import_megatron(args.load, out)
    cfg = ckpt.cfg
    warn(not_carried(ckpt))
    it = int(ckpt.common.get("iteration") or 0)
    print(f"wrote {args.save}: Megatron-LM {ckpt.fmt} checkpoint {ckpt.path} ({ckpt.source_dtype}"
          f"{', tp %d x pp %d' % (ckpt.grid['tp'], ckpt.grid['pp']) if ckpt.grid else ''}), "
          f"iteration {it}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, padded vocab "
          f"{cfg.padded_vocab_size}")
    print("continue pretraining with these flags (plus your Megatron-LM run's tokenizer, "
          "data, batch and schedule flags):")
    print(shlex.join(["python", "pretrain_gpt.py", *continue_flags(cfg, trainer_flags),
                      "--load", args.save]))
    return args.save


def to_megatron(args: argparse.Namespace) -> str:
    from megaulysses.training.megatron import export_megatron
    from megaulysses.training.megatron.convert import load_flags
    check_target(args.save, "--save", args.force)
    meta, state, path = read_any(args.load)
    source = meta.get("converted_from", {}).get("dtype")
    dtype = args.dtype or (source if source in ("float32", "bfloat16", "float16")
                           else "float32")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    with staged(args.save) as out:
        iter_dir, written = export_megatron(meta, state, out, args.ckpt_format, tp, pp,
                                            args.megatron_common_pt, args.transformer_impl,
                                            dtype)
    name = os.path.basename(iter_dir)
    print(f"wrote {args.save}: Megatron-LM {args.ckpt_format} checkpoint ({name}, {dtype}, "
          f"tp {tp} x pp {pp}) from {path}")
    extra = load_flags(iter_dir)
    if written.add_bias_linear and not written.swiglu and not written.bias_gelu_fusion:
        # the exact GeLU; --use-checkpoint-args does not restore this switch
        extra = " ".join(filter(None, [extra, "--no-bias-gelu-fusion"]))
    divisor = written.make_vocab_size_divisible_by
    print(f"load it in Megatron-LM with: --load {args.save} --use-checkpoint-args "
          f"--ckpt-format {args.ckpt_format} --transformer-impl {args.transformer_impl} "
          f"--make-vocab-size-divisible-by {divisor}{' ' + extra if extra else ''}")
    print(f"(at tp {tp} that divisor pads the vocabulary to this model's rows)")
    return args.save


def add_parsers(sub) -> None:
    a = sub.add_parser("from-megatron", help="Megatron-LM checkpoint -> our checkpoint",
                       description="A Megatron-LM save directory or iter_* directory "
                       "(torch_dist or legacy torch format, any tp/pp) -> a checkpoint our "
                       "trainer continues from (iteration, consumed samples and LR schedule "
                       "carried; a fresh optimizer).\n\n  python tools/convert_checkpoint.py "
                       "from-megatron --load megatron_ckpts --save ckpt/imported",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--load", required=True, help="Megatron-LM's --save directory or an "
                                                 "iter_XXXXXXX (or release) directory")
    a.add_argument("--save", required=True, help="output --load directory (new or empty)")
    a.add_argument("--force", action="store_true", help="replace a non-empty --save")
    b = sub.add_parser("to-megatron", help="our (or Megatron-LM's) checkpoint -> Megatron-LM",
                       description="Our checkpoint (any grid), or a Megatron-LM one to "
                       "re-shard, -> a Megatron-LM checkpoint.\n\n  python tools/"
                       "convert_checkpoint.py to-megatron --load runs/default/checkpoints "
                       "--save megatron_ckpt --ckpt-format torch_dist "
                       "--tensor-model-parallel-size 2",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--load", required=True, help="our --save directory or iter_XXXXXXX")
    b.add_argument("--save", required=True, help="output directory (new or empty)")
    b.add_argument("--ckpt-format", choices=FORMATS, default="torch_dist",
                   help="torch_dist (default; megatron-core >= 0.19's layout, the common "
                        "state inside the DCP files) or torch (legacy, one file a rank)")
    b.add_argument("--megatron-common-pt", action="store_true",
                   help="torch_dist with its common state in common.pt, as megatron-core "
                        "up to 0.18 writes and reads it")
    b.add_argument("--tensor-model-parallel-size", type=positive_int(
        "--tensor-model-parallel-size"), default=1, help="tp of the legacy files and args")
    b.add_argument("--pipeline-model-parallel-size", type=positive_int(
        "--pipeline-model-parallel-size"), default=1, help="pp of the legacy files and args")
    b.add_argument("--transformer-impl", choices=IMPLS, default="transformer_engine",
                   help="module names of the legacy format: Transformer Engine's "
                        "(Megatron-LM's default) or the local spec's")
    b.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="dtype of the weights (default: the source's, else float32)")
    b.add_argument("--force", action="store_true", help="replace a non-empty --save")
