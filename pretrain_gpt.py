"""Pretrain a GPT. With no flags: the bundled small Llama-style model on Shakespeare.

    python pretrain_gpt.py                       # the bundled default run
    python pretrain_gpt.py --help                # every flag (Megatron-LM names)
"""

import logging
import os
import sys

from megaulysses.config import CheckpointError, ConfigError, parse_args


def rank() -> int:
    """This process's global rank, from torchrun's environment (0 when run alone)."""
    return int(os.environ.get("RANK", "0"))


def setup_logging():
    # Rank 0 tells the story; the others speak only to warn.
    logging.basicConfig(level=logging.INFO if rank() == 0 else logging.WARNING,
                        stream=sys.stdout, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")


# With no flags at all, the default run also keeps its outputs (issue: a person running
# it sees curves and a checkpoint). With any flag, nothing is written unless asked for.
DEFAULT_RUN_OUTPUTS = ["--save", "runs/default/checkpoints",
                       "--tensorboard-dir", "runs/default/tensorboard",
                       "--metrics-jsonl", "runs/default/metrics.jsonl"]


def _leave_process_group():
    if "torch" not in sys.modules:  # a bad flag stopped us before anything was imported
        return
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None) -> int:
    setup_logging()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        argv = DEFAULT_RUN_OUTPUTS
        logging.info("no flags: the bundled default run (examples/pretrain_shakespeare_default.sh "
                     "spells out every flag); outputs in runs/default/")
    try:
        cfg = parse_args(argv)
        if cfg.memory.dry_run:
            from megaulysses.training.dry_run import dry_run
            return dry_run(cfg)
        from megaulysses.training.trainer import Trainer  # heavy imports after flag checks
        trainer = Trainer(cfg)
        result = trainer.train()
        # Stopped by a signal or the time limit: the job is about to end, so no sampling.
        text = trainer.generate() if result["stopped"] is None else None
    except (ConfigError, CheckpointError) as e:
        # Every rank meets the same flags and files, so every rank gets here on its own
        # (no collective needed) and exits 2; one line is enough, from rank 0.
        if rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        _leave_process_group()
    if text is not None:
        print("---- sample from the trained model ----")
        print(text)
        print("---------------------------------------")
    return 0


if __name__ == "__main__":
    sys.exit(main())
