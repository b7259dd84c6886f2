"""Train a SentencePiece tokenizer (BPE or unigram) on text or jsonl files.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok --vocab-size 8192

Writes ``<prefix>.model`` and ``<prefix>.vocab``.  Ids 0, 1, 2 are unk, bos and
eos; eos doubles as the end-of-document token.  Text is kept byte for byte
(no normalisation, unknown characters fall back to bytes), so
detokenize(tokenize(text)) == text, newlines included.
"""

import argparse
import gzip
import json
import os
import sys
from typing import Sequence

# SentencePiece trains on sentences; we feed it lines, and it skips any longer
# than max_sentence_length bytes.  Verse and prose lines are far shorter.
_MAX_LINE_BYTES = 1 << 16


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_lines(paths: list[str], json_keys: list[str]):
    """Non-empty lines of the inputs: .txt as is, .jsonl(.gz) from the given keys."""
    for path in paths:
        name = path[:-3] if path.endswith(".gz") else path
        is_json = name.endswith((".jsonl", ".json"))
        with _open_text(path) as f:
            for line_no, line in enumerate(f, 1):
                texts = _json_texts(path, line_no, line, json_keys) if is_json else [line]
                for text in texts:
                    yield from (piece for piece in text.split("\n") if piece.strip())


def _json_texts(path: str, line_no: int, line: str, keys: list[str]) -> list[str]:
    if not line.strip():
        return []
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None
    texts = []
    for key in keys:
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise ValueError(f"{path}:{line_no}: needs a string field {key!r} (--json-keys)")
        texts.append(record[key])
    return texts


def train_tokenizer(inputs: list[str], model_prefix: str, vocab_size: int = 8192,
                    model_type: str = "bpe", character_coverage: float = 1.0,
                    json_keys: Sequence[str] = ("text",), num_threads: int = 1) -> str:
    """Train and write ``<model_prefix>.model``; returns its path."""
    import sentencepiece as spm

    for path in inputs:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input: file not found: {path}")
    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    # Sampling is off (input_sentence_size=0) and the RNG is seeded, so the
    # same input gives the same model.
    spm.set_random_generator_seed(1234)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter_lines(list(inputs), list(json_keys)),
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        # Keep text exactly: no NFKC, no whitespace squeezing, no invented
        # leading space.  Lines after a newline then look like training lines.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=True,
        input_sentence_size=0,
        max_sentence_length=_MAX_LINE_BYTES,
        num_threads=num_threads,
        minloglevel=2,
    )
    return model_prefix + ".model"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="plain text files, or .jsonl files read with --json-keys")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--character-coverage", type=float, default=1.0)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--num-threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        path = train_tokenizer(args.input, args.model_prefix, args.vocab_size, args.model_type,
                               args.character_coverage, args.json_keys, args.num_threads)
    except (OSError, ValueError, RuntimeError) as e:
        message = " ".join(str(e).split())  # one line, whatever the library said
        print(f"train_tokenizer.py: error: {message}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
