"""A tiny Llama 3.1-style model saved by transformers, standing in for a Hub download.

    python examples/extend_context/make_tiny_model.py OUT_DIR

OUT_DIR gets what a Hub repository of Llama 3.1 holds, at toy size: config.json with
rope_scaling "llama3" (original context 64 positions, max_position_embeddings 128),
bfloat16 safetensors, and a byte-level BPE tokenizer.json (trained here on the bundled
Shakespeare scenes) with Llama 3's <|begin_of_text|> / <|end_of_text|> special tokens, the
eos NOT the last id (as Llama 3's 128001 of 128256). Random weights, seeded: the point is
the recipe (import, extend the context, export, generate), not the text it writes.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB = 512  # the model's embedding rows; the tokenizer has fewer ids


def scenes(limit: int = 200):
    with open(os.path.join(REPO, "data", "shakespeare.jsonl")) as f:
        for i, line in enumerate(f):
            if i == limit:
                return
            yield json.loads(line)["text"]


def train_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 64,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(scenes(), trainer)
    # Llama 3's special tokens follow the text tokens, reserved ones after its eos.
    tok.add_special_tokens([BOS, EOS] + [f"<|reserved_special_token_{i}|>" for i in range(4)])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(out)


def make_model(out: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = argv[0]
    os.makedirs(out, exist_ok=True)
    train_tokenizer(out)
    make_model(out)
    print(f"wrote {out}: a tiny Llama 3.1-style model (rope_scaling llama3, bfloat16) "
          "and its tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
