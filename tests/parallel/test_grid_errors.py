"""Invalid grids: one line from rank 0 naming the flags and the rule; every rank exits 2."""

import os
import subprocess
import sys

import pytest

from dist import free_port, run_ranks
from helpers import REPO, TINY


def main_rc(rank, world, args):
    import pretrain_gpt
    return pretrain_gpt.main(args)


CASES = [  # (world, extra flags, words the message must hold)
    (4, ["--ds-sequence-parallel-size", "3"], ["--ds-sequence-parallel-size", "world size 4"]),
    (4, ["--ds-sequence-parallel-size", "4", "--num-attention-heads", "6", "--hidden-size",
         "96", "--num-query-groups", "3"], ["--ds-sequence-parallel-size",
                                            "--num-attention-heads 6"]),
    (2, ["--ds-sequence-parallel-size", "2", "--num-attention-heads", "6", "--hidden-size",
         "96", "--num-query-groups", "3"], ["kv heads", "sp = 2"]),
    (4, ["--ds-sequence-parallel-size", "4", "--seq-length", "30"], ["--seq-length 30"]),
    (4, ["--ds-sequence-parallel-size", "2", "--global-batch-size", "6"],
     ["--global-batch-size", "dp = 2*2"]),
    (2, ["--tensor-model-parallel-size", "2", "--num-query-groups", "1"],
     ["--num-query-groups", "--tensor-model-parallel-size 2"]),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33"],
     ["--sequence-parallel", "tp*sp"]),
    (4, ["--context-parallel-size", "3"], ["--context-parallel-size", "world size 4"]),
    (4, ["--context-parallel-size", "2", "--ds-sequence-parallel-size", "2", "--seq-length",
         "36"], ["--context-parallel-size", "2*cp*sp = 2*2*2"]),
    (2, ["--context-parallel-size", "2", "--attention-sparsity", "fixed",
         "--sparse-block-size", "16"], ["--sparse-block-size", "(2*cp) = 8"]),
    (8, ["--context-parallel-size", "2", "--ds-sequence-parallel-size", "4",
         "--num-attention-heads", "12", "--hidden-size", "96", "--num-query-groups", "3",
         "--seq-length", "48"], ["kv heads", "sp = 4"]),
]
IDS = ["world", "heads", "kv-groups", "seq", "batch", "tp-kv-groups", "megatron-sp-seq",
       "cp-world", "cp-seq", "cp-sparse-block", "cp-kv-groups"]


def grid_error(world: int, flags: list) -> str:
    """The trainer's grid checks, in this process: the one-line message they raise."""
    from megaulysses.config import ConfigError, parse_args, resolve
    cfg = parse_args(TINY + flags)
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world, 1000)  # the trainer takes the vocabulary from the tokenizer
    return str(e.value)


@pytest.mark.parametrize("world,flags,words", CASES, ids=IDS)
def test_rule_names_the_flags(world, flags, words):
    message = grid_error(world, flags)
    for w in words:
        assert w in message, message


# Every rank meets the error on its own and exits 2, none waits for another: with real
# ranks, for a rule checked from the world size alone and one checked against the model.
@pytest.mark.parametrize("world,flags,words", [CASES[0], CASES[2]], ids=[IDS[0], IDS[2]])
def test_every_rank_exits_2(world, flags, words):
    assert run_ranks(main_rc, world, TINY + flags, timeout=120) == [2] * world


@pytest.mark.parametrize("world,flags,words", [CASES[3]], ids=[IDS[3]])
def test_torchrun_prints_one_line(world, flags, words):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(world), "--master-port", str(free_port()),
                           os.path.join(REPO, "pretrain_gpt.py"), *TINY, *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    # torchrun itself reports the failed workers with a traceback of its own launcher;
    # none of it may come from our code.
    assert "megaulysses/" not in proc.stderr and 'pretrain_gpt.py", line' not in proc.stderr
    for w in words:
        assert w in errors[0], errors[0]


MASK_BACKEND_CASES = [  # (flags, words): a mask the chosen backend cannot run
    (["--window-size", "8", "--attention-backend", "sdpa"],
     ["--window-size", "sdpa attention backend cannot run it", "block"]),
    (["--reset-attention-mask", "--attention-backend", "sdpa"],
     ["--reset-attention-mask", "sdpa"]),
    (["--attention-sparsity", "bigbird", "--sparse-block-size", "8", "--attention-backend",
      "flash"], ["--attention-backend", "flash"]),
    (["--window-size", "8", "--attention-dropout", "1.0"], ["--attention-dropout", "[0, 1)"]),
    (["--attention-sparsity", "fixed", "--sparse-block-size", "12"],
     ["--sparse-block-size", "--seq-length 32"]),
    (["--attention-sparsity", "fixed", "--sparse-local-blocks", "2", "--sparse-global-blocks",
      "3", "--sparse-block-size", "8"], ["--sparse-global-blocks"]),
]


@pytest.mark.parametrize("flags,words", MASK_BACKEND_CASES,
                         ids=["window-sdpa", "documents-sdpa", "sparse-flash-on-cpu",
                              "window-dropout", "sparse-block-seq", "fixed-global"])
def test_mask_the_backend_cannot_run(tmp_path, capsys, flags, words):
    import pretrain_gpt
    rc = pretrain_gpt.main(TINY + flags + ["--data-cache-path", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    for w in words:
        assert w in err[0], err[0]


def test_ring_with_another_backend_exits_2_on_every_rank():
    flags = ["--context-parallel-size", "2", "--attention-backend", "sdpa"]
    assert run_ranks(main_rc, 2, TINY + flags, timeout=120) == [2, 2]
