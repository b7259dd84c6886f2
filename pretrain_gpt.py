"""Pretrain a GPT with Megatron-LM's flags and defaults. With no flags: the bundled small
Llama-style model on Shakespeare.

    python pretrain_gpt.py                       # the bundled default run
    python pretrain_gpt.py --help                # every flag (Megatron-LM names)
"""

import logging
import os
import sys
import traceback

from megaulysses.config import CheckpointError, ConfigError, TrainingError, parse_args
from megaulysses.torch_internals import TorchInternalsError


def rank() -> int:
    """This process's global rank, from torchrun's environment (0 when run alone)."""
    return int(os.environ.get("RANK", "0"))


def setup_logging():
    # Rank 0 tells the story; the others speak only to warn.
    logging.basicConfig(level=logging.INFO if rank() == 0 else logging.WARNING,
                        stream=sys.stdout, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")


# With no flags at all: the bundled default run. It keeps its outputs (a person running
# it sees curves and a checkpoint), resumes from them when run again, and samples from the
# trained model. Its other settings are the 'shakespeare' preset (config/presets.py), which
# every run without a data source gets. With any flag, nothing is written or sampled
# unless asked for.
DEFAULT_RUN = ["--generate", "200",
               "--save", "runs/default/checkpoints", "--load", "runs/default/checkpoints",
               "--tensorboard-dir", "runs/default/tensorboard",
               "--metrics-jsonl", "runs/default/metrics.jsonl"]


def _in_process_group() -> bool:
    if "torch" not in sys.modules:  # a bad flag stopped us before anything was imported
        return False
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _leave_process_group():
    """Destroy every process group, joining their threads before the interpreter shuts
    down (dims.leave_distributed says why). The caller has dropped the trainer."""
    if _in_process_group():
        from megaulysses.parallel.dims import leave_distributed
        leave_distributed()


def _exit_after_lost_rank(e: BaseException, cfg) -> None:
    """A collective failed (a rank died or hangs): one line from every rank that is left,
    naming the lost ranks, then exit 1 at once: leaving the process group or joining a
    background save could wait on the lost rank forever. Checkpoints are committed by a
    rename, so the last one is intact."""
    from megaulysses.training.faults import failure_line
    timeout = cfg.parallel.distributed_timeout_minutes if cfg else 10.0
    try:
        line = failure_line(e, timeout)
    except Exception as inner:  # the roll call itself failed: still one line, no hang
        line = f"rank {rank()}: a collective failed ({e}); naming the lost rank failed too " \
               f"({inner})"
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _checkpoint_model(load: str, save):
    """--use-checkpoint-args: the --load checkpoint's model flags (imports torch)."""
    from megaulysses.training.checkpoint_args import model_fields
    return model_fields(load, save)


def main(argv=None) -> int:
    setup_logging()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        argv = DEFAULT_RUN
        logging.info("no flags: the bundled default run (examples/pretrain_shakespeare_default.sh "
                     "spells out every flag); outputs in runs/default/")
    cfg = trainer = None
    try:
        cfg = parse_args(argv, checkpoint_model=_checkpoint_model)
        if cfg.memory.dry_run:
            from megaulysses.training.dry_run import dry_run
            return dry_run(cfg)
        from megaulysses.torch_internals import check  # torch's private parts, present
        check(log=logging.warning)
        from megaulysses.training.trainer import Trainer  # heavy imports after flag checks
        trainer = Trainer(cfg)
        result = trainer.train()
        # Stopped by a signal or the time limit: the job is about to end, so no sampling.
        text = trainer.generate() if result["stopped"] is None else None
    except (ConfigError, CheckpointError, TorchInternalsError) as e:
        # Every rank meets the same flags and files, so every rank gets here on its own
        # (no collective needed) and exits 2; one line is enough, from rank 0.
        if rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:  # every rank stops at the same step, as decided together
        if rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)  # result validation: Megatron-LM's 16 or 17
    except Exception as e:
        from megaulysses.training.faults import is_distributed_failure
        if is_distributed_failure(e):
            _exit_after_lost_rank(e, cfg)
        if _in_process_group():  # the traceback's frames hold the trainer, whose model
            # holds process groups: their locals go so that the groups can be destroyed
            # below (the traceback still prints)
            traceback.clear_frames(e.__traceback__)
        raise
    finally:
        trainer = None  # its model and meshes hold the process groups: gone before leaving
        _leave_process_group()
    if text is not None:
        print("---- sample from the trained model ----")
        print(text)
        print("---------------------------------------")
    return 0


if __name__ == "__main__":
    sys.exit(main())
