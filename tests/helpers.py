"""Run pretrain_gpt.py on a tiny model: in-process for speed, or as a real subprocess."""

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The Llama-style architecture of the bundled run, spelled out: with --mock-data or
# --data-path the defaults are Megatron-LM's (GPT-2 style, dropout 0.1).
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0"]



def llama_config(**kw):
    """A ModelConfig of the bundled run's architecture (the dataclass defaults are
    Megatron-LM's GPT-2 style, dropout included), with `kw` on top."""
    from megaulysses.config import ModelConfig
    return ModelConfig(**{**dict(position_embedding_type="rope", normalization="RMSNorm",
                                 swiglu=True, add_bias_linear=False, hidden_dropout=0.0,
                                 attention_dropout=0.0), **kw})


# A 2-layer Llama-style GPT with GQA on the bundled Shakespeare data: ~0.5 s per step.
TINY = LLAMA + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--log-interval", "1",
        # Megatron-LM's warmup runs its first step at --lr-warmup-init: half the peak, so
        # that step updates the weights (at 0 a 2-step comparison would test one update)
        "--lr-warmup-init", "1.5e-3",
        "--eval-interval", "3", "--eval-iters", "1", "--generate", "0", "--seed", "11",
        "--peak-tflops", "1"]  # MFU against a given peak: no matmul timing at start-up


def parsed(runs) -> list:
    """Each argument list of `runs` as its Config, parsed here, once. Ranks that get the
    Configs (they pickle) skip parsing, which builds three argparse parsers (two
    of ~900 flags): 10-20% of a rank's CPU in the grid tests' short runs."""
    from megaulysses.config import parse_args
    return [parse_args(list(args)) for args in runs]


def run_inprocess(args, tmp_path, name="run") -> list[dict]:
    """main() in this process; returns the --metrics-jsonl records."""
    import pretrain_gpt
    path = os.path.join(str(tmp_path), f"{name}.jsonl")
    rc = pretrain_gpt.main(TINY + list(args) + ["--metrics-jsonl", path,
                                                "--data-cache-path", str(tmp_path / "cache")])
    assert rc == 0
    return read_jsonl(path)


def run_subprocess(args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def logged_iteration(path) -> int:
    """The newest iteration in a --metrics-jsonl that is being written (0 if none yet)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    done = [json.loads(line).get("iteration", 0) for line in lines[:-1] if line]  # last may be cut
    return max(done, default=0)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def train_losses(records) -> dict:
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def launch(args, world: int, log_prefix: str, extra_env: dict = None) -> list[subprocess.Popen]:
    """pretrain_gpt.py as `world` processes, each told its rank in the environment (as srun
    starts them, no torchrun); each one's output in {log_prefix}.rank{R}.log."""
    from dist import free_port
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS="1")
        env.update(extra_env or {})
        env.pop("SLURM_JOB_ID", None)
        log = open(f"{log_prefix}.rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"),
                                       *args], cwd=REPO, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def wait_all(procs, timeout=300) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def host_syncs():
    """A dispatch mode counting (`.n`) the ops that make a host wait for the device:
    reading a value (`.item()`, `int(t)`, `bool(t)`: _local_scalar_dense) and
    data-dependent shapes (nonzero)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostSyncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero")
            return func(*args, **(kwargs or {}))
    return HostSyncs()


def with_vocab(cfg, vocab_size: int):
    """`cfg` (frozen) with the tokenizer's vocabulary, as resolve() fills it."""
    import dataclasses
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def load_tool(name: str):
    """tools/<name>.py as a module (the tools are scripts, not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_main(tool, *args) -> tuple:
    """tool.main() in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = tool.main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def preprocess_texts(directory, name: str, texts: list, flags: list) -> str:
    """tools/preprocess_data.py (in this process) on `texts` as a jsonl in `directory`,
    each document ending with the end-of-document id: the Megatron data prefix."""
    corpus = os.path.join(str(directory), f"{name}.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    prefix = os.path.join(str(directory), name)
    args = ["--input", corpus, "--output-prefix", prefix, *flags, "--append-eod"]
    assert load_tool("preprocess_data").main(args) == 0
    return prefix + "_text_document"
