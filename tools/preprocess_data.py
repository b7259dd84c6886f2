"""Tokenize a jsonl corpus into Megatron indexed datasets (.bin/.idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod

(or --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt, or
--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR_OR_tokenizer.json: --append-eod
then appends the tokenizer's eos, or --eod-token-id; its special tokens, e.g. Llama 3's
<|begin_of_text|>, start every document, as in Megatron-LM's, unless
--tokenizer-hf-no-include-special-tokens)

Each json line is one document; every key in --json-keys gives its own
dataset ``<output-prefix>_<key>_document`` (Megatron's naming).  Documents
that tokenize to nothing are skipped.  With --workers N the input is cut into
N runs of consecutive lines, each worker writes a partial dataset, and the
parts are merged in order, so the result is identical to --workers 1.
"""

import argparse
import gzip
import json
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile

import numpy as np

try:
    import megaulysses  # noqa: F401
except ImportError:  # run from a checkout without pip install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaulysses.data.indexed import IndexedDatasetWriter, optimal_dtype  # noqa: E402
from megaulysses.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402


class InputError(Exception):
    """Bad input or flags; main() prints the message as one line and exits 2."""


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def count_lines(path: str) -> int:
    """Line count; also proves up front that the whole file decodes."""
    try:
        with _open_text(path) as f:
            return sum(1 for _ in f)
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (OSError, EOFError) as e:
        raise InputError(f"{path}: unreadable ({e})") from None


def encode_line(tokenizer, path: str, line_no: int, line: str, keys: list[str],
                append_eod: bool) -> dict[str, list[int]]:
    """Token ids per key for one json line ({} for a blank line)."""
    if not line.strip():
        return {}
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{line_no}: invalid JSON ({e.msg}); "
                         f"each line must be one json object") from None
    ids = {}
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            raise InputError(f"{path}:{line_no}: missing key {key!r} (--json-keys)")
        if not isinstance(record[key], str):
            raise InputError(f"{path}:{line_no}: {key!r} must be a string")
        try:
            tokens = tokenizer.tokenize(record[key])
        except ValueError as e:
            raise InputError(f"{path}:{line_no}: cannot tokenize {key!r} ({e})") from None
        if tokens and append_eod:
            tokens.append(tokenizer.eod)
        _check_range(tokens, tokenizer.vocab_size, path, line_no)
        ids[key] = tokens
    return ids


def _check_range(tokens: list[int], vocab_size: int, path: str, line_no: int) -> None:
    # Only NullTokenizer input can be out of range, but a bad id would
    # silently wrap in a uint16 .bin, so check every document.
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        bad = min(tokens) if min(tokens) < 0 else max(tokens)
        raise InputError(f"{path}:{line_no}: token id {bad} outside the vocabulary "
                         f"[0, {vocab_size})")


def encode_range(opts: dict, first: int, stop: int, prefix: str, progress=None) -> dict:
    """Tokenize lines [first, stop) (0-based) into one dataset per key under prefix.

    Returns {key: (documents, tokens)}.  Runs in the main process or a worker.
    """
    tokenizer = _build(opts)
    keys, dtype = opts["json_keys"], optimal_dtype(tokenizer.vocab_size)
    writers = {k: IndexedDatasetWriter(output_prefix_for(prefix, k), dtype) for k in keys}
    stats = {k: [0, 0] for k in keys}
    try:
        pending = 0
        with _open_text(opts["input"]) as f:
            for line_no, line in enumerate(f):
                if line_no >= stop:
                    break
                if line_no < first:
                    continue
                for key, tokens in encode_line(tokenizer, opts["input"], line_no + 1, line,
                                               keys, opts["append_eod"]).items():
                    if tokens:
                        writers[key].add_document(np.asarray(tokens, dtype=np.int64))
                        stats[key][0] += 1
                        stats[key][1] += len(tokens)
                pending += 1
                if progress is not None and pending == opts["log_interval"]:
                    progress(pending)
                    pending = 0
        if progress is not None and pending:
            progress(pending)
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    for writer in writers.values():
        writer.finalize()
    return {k: tuple(v) for k, v in stats.items()}


def _build(opts: dict):
    return build_tokenizer(opts["tokenizer_type"], opts["tokenizer_model"], opts["vocab_size"],
                           opts["vocab_file"], opts["merge_file"], opts["eod_token_id"],
                           opts["include_special_tokens"])


def _worker(opts: dict, first: int, stop: int, part_prefix: str, progress_queue) -> dict:
    return encode_range(opts, first, stop, part_prefix, progress_queue.put)


def _run_workers(opts: dict, n_lines: int, tmp_dir: str, bar) -> list[tuple[str, dict]]:
    """Encode N consecutive line ranges in parallel; returns (part prefix, stats) in order."""
    n = opts["workers"]
    bounds = [n_lines * i // n for i in range(n + 1)]
    parts = [os.path.join(tmp_dir, f"part{i:04d}") for i in range(n)]
    with multiprocessing.Manager() as manager, multiprocessing.Pool(n) as pool:
        progress = manager.Queue()
        jobs = [pool.apply_async(_worker, (opts, bounds[i], bounds[i + 1], parts[i], progress))
                for i in range(n)]
        while not all(job.ready() for job in jobs):
            try:
                bar.update(progress.get(timeout=0.2))
            except queue.Empty:
                pass
        while not progress.empty():
            bar.update(progress.get())
        # get() re-raises a worker's error; the first part's error comes first,
        # so the reported line is the earliest bad line, as with one worker.
        return [(parts[i], job.get()) for i, job in enumerate(jobs)]


def preprocess(input_path: str, output_prefix: str, json_keys: list[str], tokenizer_type: str,
               tokenizer_model: str | None = None, vocab_size: int | None = None,
               append_eod: bool = False, workers: int = 1, log_interval: int = 1000,
               vocab_file: str | None = None, merge_file: str | None = None,
               eod_token_id: int | None = None,
               include_special_tokens: bool | None = None) -> dict:
    """Tokenize input_path; returns {output dataset prefix: (documents, tokens)}.
    `include_special_tokens`: HuggingFaceTokenizer's special tokens (None: not given, so
    included, as Megatron-LM's preprocess_data.py does; False: the text's ids only).

    Raises InputError for bad input; nothing is left under the final names then.
    """
    from tqdm import tqdm

    if not os.path.isfile(input_path):
        raise InputError(f"--input: file not found: {input_path}")
    if workers < 1 or log_interval < 1:
        raise InputError("--workers and --log-interval: must be at least 1")
    opts = dict(input=input_path, json_keys=list(json_keys), tokenizer_type=tokenizer_type,
                tokenizer_model=tokenizer_model, vocab_size=vocab_size, vocab_file=vocab_file,
                merge_file=merge_file, eod_token_id=eod_token_id,
                include_special_tokens=include_special_tokens, append_eod=append_eod,
                workers=workers, log_interval=log_interval)
    try:
        tokenizer = _build(opts)
    except (OSError, ValueError) as e:
        raise InputError(str(e)) from None
    n_lines = count_lines(input_path)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    # disable=None: no bar when stderr is not a terminal (logs, tests).
    with tqdm(total=n_lines, unit="line", desc="tokenizing", disable=None,
              file=sys.stderr) as bar:
        if workers == 1:
            stats = encode_range(opts, 0, n_lines, output_prefix, bar.update)
            return {output_prefix_for(output_prefix, k): v for k, v in stats.items()}
        # Parts live next to the output so merging does not cross file systems.
        tmp_dir = tempfile.mkdtemp(prefix=".preprocess-",
                                   dir=os.path.dirname(os.path.abspath(output_prefix)))
        try:
            parts = _run_workers(opts, n_lines, tmp_dir, bar)
            return _merge_parts(parts, output_prefix, json_keys,
                                optimal_dtype(tokenizer.vocab_size))
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def _merge_parts(parts: list[tuple[str, dict]], output_prefix: str, json_keys: list[str],
                 dtype) -> dict:
    """Concatenate the parts per key into the final datasets."""
    results = {}
    for key in json_keys:
        final = output_prefix_for(output_prefix, key)
        with IndexedDatasetWriter(final, dtype) as writer:
            for part_prefix, _ in parts:
                writer.merge(output_prefix_for(part_prefix, key))
        results[final] = tuple(sum(stats[key][i] for _, stats in parts) for i in range(2))
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help=".jsonl or .jsonl.gz, one document per line")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    p.add_argument("--eod-token-id", type=int, default=None,
                   help="HuggingFaceTokenizer: the end-of-document id (default: its eos)")
    special = p.add_mutually_exclusive_group()  # dest None: not given (included)
    special.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_const",
                         const=False, dest="include_special_tokens",
                         help="HuggingFaceTokenizer: the text's ids only (default, as "
                              "Megatron-LM's: the tokenizer's special tokens are added, e.g. "
                              "Llama 3's <|begin_of_text|> before every document)")
    special.add_argument("--tokenizer-hf-include-special-tokens", action="store_const",
                         const=True, dest="include_special_tokens",
                         help="HuggingFaceTokenizer: add them (the default; kept for older "
                              "commands)")
    p.add_argument("--append-eod", action="store_true", help="end every document with eod")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=1000,
                   help="documents between progress bar updates")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        results = preprocess(args.input, args.output_prefix, args.json_keys, args.tokenizer_type,
                             args.tokenizer_model, args.vocab_size, args.append_eod,
                             args.workers, args.log_interval, args.vocab_file, args.merge_file,
                             args.eod_token_id, args.include_special_tokens)
    except (InputError, OSError) as e:
        print(f"preprocess_data.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for prefix, (docs, tokens) in results.items():
        print(f"wrote {prefix}.bin/.idx: {docs} documents, {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
