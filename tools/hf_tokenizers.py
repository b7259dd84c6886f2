"""The tokenizer on both sides of a conversion: which files a Hugging Face directory's
tokenizer is, what our checkpoint stores of it, and the files to-hf writes back.

  kind            a Hugging Face directory has      our checkpoint stores   our flags
  sentencepiece   tokenizer.model                   tokenizer.model         --tokenizer-model
  gpt2            vocab.json + merges.txt           vocab.json, merges.txt  GPT2BPETokenizer
  hf              tokenizer.json (+ its configs)    tokenizer.json,         HuggingFaceTokenizer
                                                    tokenizer_config.json,
                                                    special_tokens_map.json

from-hf takes the first that applies: --tokenizer-model (a directory or a .json file is a
Hugging Face tokenizer, another file a SentencePiece model); tokenizer.model; GPT-2's
vocab.json and merges.txt for a gpt2 model or a directory without tokenizer.json (a
Qwen directory has all three, and its vocab.json is not GPT-2's) unless tokenizer.json is
there and vocab.json lacks <|endoftext|> (an added token of tokenizer.json only);
tokenizer.json; else none (a NullTokenizer checkpoint, with a warning).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Optional

from hf_errors import ConvertError
from hf_sentencepiece import PROBE_TEXT, TOKENIZER_MODEL, save_tokenizer, sp_processor

GPT2_FILES = ("vocab.json", "merges.txt")  # GPT2BPETokenizer's, in checkpoints and on the Hub
TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


@dataclass
class Found:
    """A tokenizer: `kind` (sentencepiece, gpt2, hf, or None: no tokenizer), its files
    {name in our checkpoint: path}, its vocabulary size, and (hf) its end-of-document id."""
    kind: Optional[str]
    files: dict = field(default_factory=dict)
    vocab_size: int = 0
    eod: Optional[int] = None


# -- Hugging Face directory -> our checkpoint -------------------------------------------------

def _choose(hf_dir: str, given: Optional[str], model_type: str) -> tuple:
    """(kind, path, the flag or file to name in errors)."""
    if given:
        hf = os.path.isdir(given) or given.endswith(".json")
        return ("hf" if hf else "sentencepiece"), given, "--tokenizer-model"
    here = {name: os.path.isfile(os.path.join(hf_dir, name))
            for name in (TOKENIZER_MODEL, TOKENIZER_JSON, *GPT2_FILES)}
    if here[TOKENIZER_MODEL]:
        return "sentencepiece", os.path.join(hf_dir, TOKENIZER_MODEL), None
    if all(here[n] for n in GPT2_FILES) and (model_type == "gpt2" or not here[TOKENIZER_JSON]) \
            and (not here[TOKENIZER_JSON] or _has_gpt2_eod(os.path.join(hf_dir, "vocab.json"))):
        return "gpt2", hf_dir, None
    if here[TOKENIZER_JSON]:
        return "hf", hf_dir, None
    return None, None, None


def _has_gpt2_eod(vocab: str) -> bool:
    """Whether GPT-2's vocab.json holds <|endoftext|> (GPT2BPETokenizer's end of document).
    A repository may keep it as an added token of tokenizer.json only: that one is read
    then. An unreadable vocab.json says True (GPT2BPETokenizer's error names it)."""
    from megaulysses.data.tokenizer import GPT2_EOD
    try:
        with open(vocab, encoding="utf-8") as f:
            return GPT2_EOD in json.load(f)
    except (OSError, ValueError):
        return True


def import_tokenizer(hf_dir: str, given: Optional[str], model_type: str, hf_vocab: int,
                     eod: Optional[int] = None) -> tuple:
    """(Found, a warning or None) for from-hf; ConvertError for a tokenizer that is
    unreadable or bigger than the model's vocab_size. `eod`: from-hf's --eod-token-id."""
    kind, path, flag = _choose(hf_dir, given, model_type)
    if eod is not None and kind != "hf":
        raise ConvertError("--eod-token-id", f"only for a Hugging Face tokenizer.json (this "
                                             f"tokenizer is {kind or 'none'})")
    if kind is None:
        return Found(None, vocab_size=hf_vocab), (
            f"{hf_dir} has no tokenizer (SentencePiece {TOKENIZER_MODEL}, GPT-2's "
            f"{' and '.join(GPT2_FILES)}, or {TOKENIZER_JSON}): the checkpoint is for "
            f"--tokenizer-type NullTokenizer --vocab-size {hf_vocab - 1} (or pass "
            "--tokenizer-model)")
    if kind == "hf":
        return _import_hf(path, flag, hf_vocab, eod), None
    if kind == "gpt2":
        gpt2 = {name: os.path.join(hf_dir, name) for name in GPT2_FILES}
        return Found("gpt2", gpt2, _gpt2_vocab_size(gpt2, hf_vocab)), None
    size = sp_processor(path, flag or path).get_piece_size()
    if size > hf_vocab:
        raise ConvertError(flag or path, f"{size} pieces, more than the model's vocab_size "
                                         f"{hf_vocab}")
    return Found("sentencepiece", {TOKENIZER_MODEL: path}, size), None


def _hf(path: str, flag: Optional[str], eod: Optional[int] = None):
    """HuggingFaceTokenizer(path), its errors (which name the file) as ConvertError naming
    `flag` (default --hf-dir), or --eod-token-id for that flag's."""
    from megaulysses.data.hf_tokenizer import HuggingFaceTokenizer
    try:
        return HuggingFaceTokenizer(path, eod_token_id=eod)
    except ValueError as e:  # "--tokenizer-model: <the file and its rule>", "--eod-token-id: ..."
        said, _, rule = str(e).partition(": ")
        raise ConvertError(said if said == "--eod-token-id" else flag or "--hf-dir",
                           rule or str(e)) from None


def _import_hf(path: str, flag: Optional[str], hf_vocab: int, eod: Optional[int]) -> Found:
    tok = _hf(path, flag, eod)
    if tok.vocab_size > hf_vocab:
        raise ConvertError(flag or tok.json_path, f"{tok.vocab_size} tokens (ids 0 to "
                                                  f"{tok.vocab_size - 1}), more than the "
                                                  f"model's vocab_size {hf_vocab}")
    return Found("hf", dict(tok.files), tok.vocab_size, tok.eod)


def _gpt2_vocab_size(files: dict, hf_vocab: int) -> int:
    """Our GPT2BPETokenizer's vocabulary from the files (ConvertError naming the file)."""
    from megaulysses.data.tokenizer import GPT2BPETokenizer
    try:
        size = GPT2BPETokenizer(*files.values()).vocab_size
    except ValueError as e:
        flag, _, rule = str(e).partition(": ")
        raise ConvertError(files["vocab.json" if flag == "--vocab-file" else "merges.txt"],
                           rule) from None
    if size > hf_vocab:
        raise ConvertError(files["vocab.json"], f"{size} tokens, more than the model's "
                                                f"vocab_size {hf_vocab}")
    return size


def tokenizer_flags(found: Found, inside: str) -> list:
    """pretrain_gpt.py's flags for the tokenizer copied into the checkpoint directory
    `inside` (written already: an hf tokenizer whose stored files name another eos than
    the source directory's gets --eod-token-id)."""
    if found.kind == "sentencepiece":
        return ["--tokenizer-model", os.path.join(inside, TOKENIZER_MODEL)]
    if found.kind == "gpt2":
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                os.path.join(inside, "vocab.json"), "--merge-file",
                os.path.join(inside, "merges.txt")]
    if found.kind == "hf":
        flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", inside]
        if _hf(inside, "--save", found.eod).eos != found.eod:  # eos in config.json only,
            # or --eod-token-id
            flags += ["--eod-token-id", str(found.eod)]
        return flags
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(found.vocab_size - 1)]


# -- our checkpoint -> Hugging Face directory --------------------------------------------------

def checkpoint_tokenizer(meta: dict, path: str, skip: bool) -> tuple:
    """(Found, a warning or None): the run's tokenizer files inside the checkpoint."""
    if skip:
        return Found(None), None
    for kind, names in (("sentencepiece", (TOKENIZER_MODEL,)), ("gpt2", GPT2_FILES),
                        ("hf", (TOKENIZER_JSON,))):
        if all(os.path.isfile(os.path.join(path, name)) for name in names):
            if kind == "hf":
                from megaulysses.data.hf_tokenizer import hf_tokenizer_files
                return Found(kind, hf_tokenizer_files(path)), None
            return Found(kind, {name: os.path.join(path, name) for name in names}), None
    run_type = (meta.get("tokenizer") or {}).get("type")
    why = "a NullTokenizer run" if run_type == "NullTokenizer" else (
        f"no {TOKENIZER_MODEL}, {' and '.join(GPT2_FILES)} or {TOKENIZER_JSON} in it")
    return Found(None), f"{path}: {why}: exported without tokenizer files"


def tokenless_ids(meta: dict, vocab_size: int) -> dict:
    """Special token ids without tokenizer files: those of the Hugging Face model this
    checkpoint was imported from, or a NullTokenizer's eod (the id right after the
    given vocabulary), else none."""
    if "token_ids" in meta.get("converted_from", {}):
        return meta["converted_from"]["token_ids"]
    if (meta.get("tokenizer") or {}).get("type") == "NullTokenizer":
        return {"eos": vocab_size - 1}
    return {}


def save_gpt2_tokenizer(vocab: str, merges: str, out: str, max_length: int) -> dict:
    """GPT-2's tokenizer files from a GPT2BPETokenizer run's vocab.json and merges.txt,
    checked to encode the probe text as our tokenizer does."""
    from transformers import GPT2Tokenizer
    from megaulysses.data.tokenizer import GPT2_EOD, GPT2BPETokenizer
    ours = GPT2BPETokenizer(vocab, merges)
    # split_special_tokens: "<|endoftext|>" written in text stays text, as in Megatron-LM.
    theirs = GPT2Tokenizer(vocab=vocab, merges=merges, split_special_tokens=True,
                           clean_up_tokenization_spaces=False)
    probe = PROBE_TEXT + GPT2_EOD
    if theirs(probe).input_ids != ours.tokenize(probe):
        raise ConvertError(vocab, "the Hugging Face GPT-2 tokenizer built from it encodes a "
                                  "probe text differently from ours; pass --no-tokenizer")
    theirs.model_max_length = max_length  # after the probe, which may be longer
    theirs.save_pretrained(out)
    # GPT-2's own files too, as its repository has them (slow tokenizers, from-hf).
    for name, path in zip(GPT2_FILES, (vocab, merges), strict=True):
        shutil.copyfile(path, os.path.join(out, name))
    return {"bos": ours.eod, "eos": ours.eod, "unk": ours.eod, "pad": None}


def _token_text(json_path: str, token_id: Optional[int]) -> Optional[str]:
    from tokenizers import Tokenizer
    return None if token_id is None else Tokenizer.from_file(json_path).id_to_token(token_id)


def save_hf_tokenizer(files: dict, out: str, max_length: int, eod: Optional[int]) -> dict:
    """The stored tokenizer.json and its configs as they are (plus a tokenizer_config.json
    for transformers where the run had a lone tokenizer.json); the special ids. `eod`: the
    run's --eod-token-id, or the source model's eos: used where the files name none."""
    directory = os.path.dirname(files[TOKENIZER_JSON])
    tok = _hf(directory, "--load", eod)
    for name, path in files.items():
        shutil.copyfile(path, os.path.join(out, name))
    eos = tok.eos if tok.eos is not None else tok.eod
    if TOKENIZER_CONFIG not in files:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                  "clean_up_tokenization_spaces": False,
                  "eos_token": _token_text(tok.json_path, eos),
                  "bos_token": _token_text(tok.json_path, tok.bos)}
        with open(os.path.join(out, TOKENIZER_CONFIG), "w") as f:
            json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2)
    pad = _pad_token(os.path.join(out, TOKENIZER_CONFIG), tok)
    return {"bos": tok.bos, "eos": eos, "pad": pad}


def _pad_token(config_path: str, tok) -> Optional[int]:
    """The id of tokenizer_config.json's pad_token, if it names one in the vocabulary."""
    with open(config_path) as f:
        pad = json.load(f).get("pad_token")
    if isinstance(pad, dict):
        pad = pad.get("content")
    from tokenizers import Tokenizer
    return Tokenizer.from_file(tok.json_path).token_to_id(pad) if isinstance(pad, str) \
        else None


def check_hf_tokenizer(out: str, found: Found) -> None:
    """AutoTokenizer loads the written directory and encodes a probe text as our
    HuggingFaceTokenizer does (run when config.json is there: AutoTokenizer may read it)."""
    from transformers import AutoTokenizer
    # eod 0: any valid id, so that a tokenizer naming no eos still loads (eos is not probed)
    tok = _hf(os.path.dirname(found.files[TOKENIZER_JSON]), "--load", 0)
    try:
        theirs = AutoTokenizer.from_pretrained(out)
    except Exception as e:  # transformers' many ways to fail on a tokenizer it cannot load
        why = " ".join(str(e).split())
        raise ConvertError(tok.json_path, f"transformers' AutoTokenizer cannot load it ({why}); "
                                          "pass --no-tokenizer") from None
    if theirs.encode(PROBE_TEXT, add_special_tokens=False) != tok.tokenize(PROBE_TEXT):
        raise ConvertError(tok.json_path, "transformers' AutoTokenizer encodes a probe text "
                                          "differently from the tokenizers library with it; "
                                          "pass --no-tokenizer")


def export_tokenizer(found: Found, out: str, max_length: int, eod: Optional[int]) -> dict:
    """The checkpoint's tokenizer files as Hugging Face's, in `out`; the special ids."""
    if found.kind == "sentencepiece":
        return save_tokenizer(found.files[TOKENIZER_MODEL], out, max_length)
    if found.kind == "gpt2":
        vocab, merges = (found.files[name] for name in GPT2_FILES)
        return save_gpt2_tokenizer(vocab, merges, out, max_length)
    return save_hf_tokenizer(found.files, out, max_length, eod)
