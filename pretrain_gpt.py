"""Pretrain a GPT. With no flags: the bundled small Llama-style model on Shakespeare.

    python pretrain_gpt.py                       # the bundled default run
    python pretrain_gpt.py --help                # every flag (Megatron-LM names)
"""

import logging
import sys

from megaulysses.config import ConfigError, parse_args
from megaulysses.training.checkpoint import CheckpointError


def setup_logging():
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")


def main(argv=None) -> int:
    setup_logging()
    try:
        cfg = parse_args(argv)
        from megaulysses.training.trainer import Trainer  # heavy imports after flag checks
        trainer = Trainer(cfg)
        trainer.train()
        text = trainer.generate()
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if text is not None:
        print("---- sample from the trained model ----")
        print(text)
        print("---------------------------------------")
    return 0


if __name__ == "__main__":
    sys.exit(main())
