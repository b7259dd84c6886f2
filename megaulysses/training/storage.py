"""The storage a run writes to: checked before any step, planned, and kept within bounds.

- `check_writable`: --save, --tensorboard-dir, --metrics-jsonl's directory, --profile's
  trace directory and --wandb-save-dir are made if missing and probed with a real write
  and removal by the first rank of every node (a node-local path is checked where it
  lives); any failure is one ConfigError on every rank, naming the flag, the path and
  the OS error.
- `checkpoint_bytes`: the size of one checkpoint, known before the first save: every
  parameter in fp32 and AdamW's two fp32 moments (DCP stores whole-model tensors, the
  same whatever the grid), DCP's per-tensor entries (the flattened optimizer state keeps
  each parameter's param-group settings as small pickled items: measured 23 KiB a
  parameter tensor with its metadata), the RNG file of each rank and the tokenizer copy.
- `Retention`: which committed checkpoints --keep-last and --save-retain-interval keep.
- `space_error` / `failure_reason`: the words of a save that cannot fit or did not.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch

from megaulysses.config import Config, ConfigError, ModelConfig
from megaulysses.config.fields import filled
from megaulysses.data.hf_tokenizer import hf_tokenizer_files
from megaulysses.model.gpt import GPT, parameter_count
from megaulysses.parallel.comm import Comm
from megaulysses.training.profiling import trace_dir

log = logging.getLogger(__name__)

MIB = 2 ** 20
PER_TENSOR_BYTES = 24 * 1024  # DCP's items and metadata per parameter tensor (23 measured)
PER_RANK_BYTES = 16 * 1024  # rng_rankNNNNN.pt (14 KiB measured)
FIXED_BYTES = 16 * 1024  # trainer_state.json, COMMITTED


def output_dirs(cfg: Config) -> list[tuple[str, str]]:
    """(flag, directory) of everything the run writes."""
    out = [("--save", cfg.train.save), ("--tensorboard-dir", cfg.log.tensorboard_dir)]
    if cfg.log.metrics_jsonl:
        out.append(("--metrics-jsonl", os.path.dirname(os.path.abspath(cfg.log.metrics_jsonl))))
    if cfg.log.profile:  # validate() made sure there is a --tensorboard-dir
        out.append(("--profile", trace_dir(filled(cfg.log.tensorboard_dir, "--tensorboard-dir"))))
    if cfg.log.wandb_project:  # resolve() filled in the default, <--save>/wandb
        out.append(("--wandb-save-dir", cfg.log.wandb_save_dir))
    return [(flag, path) for flag, path in out if path]


def probe(directory: str) -> Optional[str]:
    """None when `directory` can be made and written (a file written, synced, removed),
    else the OS error in words."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=".write_probe_", dir=directory)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(path)
    except OSError as e:
        return (e.strerror or str(e)).lower()
    return None


def check_writable(cfg: Config, comm: Comm) -> None:
    """Every output directory probed by the first rank of each node; ConfigError on every
    rank when one fails anywhere."""
    found = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        for flag, directory in output_dirs(cfg):
            reason = probe(directory)
            if reason is not None:
                found = (flag, f"cannot write to {directory}: {reason}")
                break
    found = comm.first_of_any_rank(found)
    if found is not None:
        raise ConfigError(*found)


# a checkpoint's copies of the run's tokenizer files, by these names
TOKENIZER_FILE = "tokenizer.model"
GPT2_VOCAB_FILE, GPT2_MERGES_FILE = "vocab.json", "merges.txt"  # GPT-2's own names


def tokenizer_files(cfg: Config) -> dict[str, str]:
    """The tokenizer files a checkpoint copies: {name in the checkpoint: the run's file}
    (none for NullTokenizer)."""
    d = cfg.data
    if d.tokenizer_type == "NullTokenizer":
        return {}
    if d.tokenizer_type == "GPT2BPETokenizer":  # the rules require both files with it
        return {GPT2_VOCAB_FILE: filled(d.vocab_file, "--vocab-file"),
                GPT2_MERGES_FILE: filled(d.merge_file, "--merge-file")}
    model = filled(d.tokenizer_model, "--tokenizer-model")  # the bundled one by default
    if d.tokenizer_type == "HuggingFaceTokenizer":  # tokenizer.json and its configs, present
        return hf_tokenizer_files(model)
    return {TOKENIZER_FILE: model}


def checkpoint_bytes(m: ModelConfig, tokenizer: Union[str, Iterable[str], None] = None,
                     world: int = 1, optim: bool = True) -> int:
    """The bytes of one checkpoint (model and optimizer states, whole-model shapes).
    `tokenizer`: the tokenizer file or files it copies; `optim`: False under
    --no-save-optim (the parameters only)."""
    # fp32 parameters, AdamW's exp_avg and exp_avg_sq
    states = (3 if optim else 1) * 4 * parameter_count(m)
    with torch.device("meta"):
        tensors = sum(1 for _ in GPT(m).parameters())
    paths = [tokenizer] if isinstance(tokenizer, str) else list(tokenizer or ())
    copy = sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
    return states + tensors * PER_TENSOR_BYTES + world * PER_RANK_BYTES + copy + FIXED_BYTES


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f} MiB"


@dataclass(frozen=True)
class Retention:
    """--keep-last K (the newest K) and --save-retain-interval N (iterations divisible by
    N): a committed checkpoint is kept when either keeps it; without either, all are
    kept. The newest and those `protected` (the one `latest` names, the one loaded)
    never go."""
    keep_last: Optional[int] = None
    retain_interval: Optional[int] = None

    @property
    def active(self) -> bool:
        return bool(self.keep_last or self.retain_interval)

    def prunable(self, committed: list[int], protected: Iterable[Optional[int]] = ()
                 ) -> list[int]:
        """The iterations of `committed` that the policy removes, oldest first."""
        if not self.active or not committed:
            return []
        ordered = sorted(committed)
        keep = {ordered[-1], *protected}
        if self.keep_last:
            keep.update(ordered[-self.keep_last:])
        if self.retain_interval:
            keep.update(it for it in ordered if it % self.retain_interval == 0)
        return [it for it in ordered if it not in keep]

    def flags(self) -> str:
        parts = [f"--keep-last {self.keep_last}" if self.keep_last else "",
                 f"--save-retain-interval {self.retain_interval}" if self.retain_interval
                 else ""]
        return " and ".join(p for p in parts if p)


def is_no_space(e: BaseException) -> bool:
    """An ENOSPC (or EDQUOT) anywhere in the exception's chain."""
    cur: Optional[BaseException] = e
    while cur is not None:
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def failure_reason(e: BaseException, directory: str, need: int) -> str:
    """A failed write in words: the OS error where there is one; torch's writers report a
    full disk as a short write ("unexpected pos"), so little space left says it too."""
    chain: list[BaseException] = []
    cur: Optional[BaseException] = e
    while cur is not None and len(chain) < 10:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for err in chain:
        if isinstance(err, OSError) and err.strerror:
            return err.strerror.lower()
    try:
        if free_bytes(directory) < min(need, 64 * MIB):
            return "no space left on device"
    except OSError:
        pass
    return str(chain[-1]).strip().splitlines()[0][:200] if chain else "unknown error"
