"""HuggingFaceTokenizer's special tokens by default, as Megatron-LM's (issue 39, item 6):
its HuggingFaceTokenizer encodes with the tokenizer's post-processor unless
--tokenizer-hf-no-include-special-tokens, so tools/preprocess_data.py writes a Llama 3
style tokenizer's <|begin_of_text|> before every document, and pretrain_gpt.py's tokenizer
does the same. A tiny word-level tokenizer built here (a TemplateProcessing post-processor
adding the bos), nothing downloaded; ids compared exactly."""

import json

import pytest

from helpers import preprocess_texts

from megaulysses.config import ConfigError, parse_args
from megaulysses.data.indexed import IndexedDataset
from megaulysses.data.tokenizer import build_tokenizer

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
WORDS = ["hello", "world", "to", "be", "or", "not"]
HF = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """tokenizer.json (ids 0..5 the words, 6 [UNK], 7 bos, 8 eos; the post-processor puts
    the bos first) and tokenizer_config.json naming the eos."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    vocab = {w: i for i, w in enumerate(WORDS + ["[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 7)])
    directory = tmp_path_factory.mktemp("hf_bos")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS}))
    return directory


DOCS = ["hello world", "to be or not to be"]
IDS = [[0, 1], [2, 3, 4, 5, 2, 3]]


@pytest.mark.parametrize("flags,bos", [([], [7]),
                                       (["--tokenizer-hf-include-special-tokens"], [7]),
                                       (["--tokenizer-hf-no-include-special-tokens"], [])],
                         ids=["default", "include", "no-include"])
def test_preprocess_data_adds_the_bos_unless_told_not_to(tokenizer_dir, tmp_path, flags, bos):
    prefix = preprocess_texts(tmp_path, "d", DOCS, HF + [str(tokenizer_dir)] + flags)
    data = IndexedDataset(prefix)
    assert [data.get(i).tolist() for i in range(len(data))] == [bos + ids + [8] for ids in IDS]


def test_the_training_tokenizer_follows_the_same_flags(tokenizer_dir):
    """pretrain_gpt.py's flags build the same tokenizer (what --generate-prompt encodes);
    given to another tokenizer type they are an error naming the flag given."""
    d = str(tokenizer_dir)
    for flags, first in (([], 7), (["--tokenizer-hf-include-special-tokens"], 7),
                         (["--tokenizer-hf-no-include-special-tokens"], 0)):
        data = parse_args(["--mock-data", *HF, d, *flags]).data
        tok = build_tokenizer(data.tokenizer_type, data.tokenizer_model,
                              include_special_tokens=data.tokenizer_hf_include_special_tokens)
        assert tok.tokenize("hello")[0] == first, flags
    for flag in ("--tokenizer-hf-include-special-tokens",
                 "--tokenizer-hf-no-include-special-tokens"):
        with pytest.raises(ConfigError, match=f"^{flag}: is only used with --tokenizer-type "
                                              "HuggingFaceTokenizer"):
            parse_args(["--mock-data", flag])
