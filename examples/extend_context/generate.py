"""Load an exported directory with transformers alone and generate from it.

    python examples/extend_context/generate.py HF_DIR [PROMPT]

What a user of the exported model does: AutoTokenizer and AutoModelForCausalLM, nothing of
megaulysses. Prints the model's context and RoPE settings, then a greedy continuation.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: generate.py HF_DIR [PROMPT]", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf_dir, prompt = argv[0], argv[1] if len(argv) == 2 else "ROMEO:\n"
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    c = model.config
    print(f"{type(model).__name__} ({c.dtype}): max_position_embeddings "
          f"{c.max_position_embeddings}, rope {c.rope_parameters}")
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=40, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    print(repr(tok.decode(out[0], skip_special_tokens=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
