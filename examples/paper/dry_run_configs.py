"""Dry-run the configurations that examples/paper/common.sh collected, in one process.

Each line of the file is NAME <tab> GPUS <tab> FLAGS (shell-quoted). Each configuration
runs exactly as `python pretrain_gpt.py --dry-run --dry-run-world-size GPUS
--dry-run-device cuda FLAGS` would, after a line `=== NAME: GPUS GPUs ===`. Exits 1 if
any configuration fails (its error is printed), else 0.
"""

import os
import shlex
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import pretrain_gpt  # noqa: E402


def main(path: str) -> int:
    failed = []
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    for line in lines:
        name, gpus, flags = line.split("\t", 2)
        print(f"=== {name}: {gpus} GPUs ===", flush=True)
        argv = ["--dry-run", "--dry-run-world-size", gpus, "--dry-run-device", "cuda",
                *shlex.split(flags)]
        try:
            rc = pretrain_gpt.main(argv)
        except SystemExit as e:  # argparse errors
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 -- report it and go on to the next one
            traceback.print_exc(file=sys.stdout)
            rc = 1
        if rc:
            failed.append(name)
            print(f"=== {name}: FAILED (exit {rc}) ===", flush=True)
    if failed:
        print("failed: " + " ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
