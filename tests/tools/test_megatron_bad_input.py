"""Bad Megatron-LM checkpoints and flags: one line naming the file or flag, exit 2, nothing
written. The sources are real Megatron-LM-format directories, written by to-megatron
(whose loading into megatron-core itself is tests/tools/test_megatron_checkpoints.py's),
then damaged the way users' copies are."""

import os

import pytest
import torch

from helpers import load_tool, run_main

convert = load_tool("convert_checkpoint")

SHAPE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=96, vocab_size=200, make_vocab_size_divisible_by=128,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """Our model-only checkpoint of a tiny Llama-style model, random weights."""
    from megaulysses.config import ModelConfig
    from megaulysses.model.gpt import GPT
    from megaulysses.training.saver import write_model_checkpoint
    cfg = ModelConfig(**SHAPE)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=gen) for k, v in GPT(cfg).state_dict().items()}
    path = str(tmp_path_factory.mktemp("ours") / "ckpt")
    write_model_checkpoint(path, state, cfg.shape_dict())
    return path


def to_megatron(ours, out, *flags):
    rc, _, err = run_main(convert, "to-megatron", "--load", ours, "--save", out, *flags)
    assert rc == 0, err
    return out


def fails(tmp_path, *args) -> str:
    """The tool's one error line; the output directory was not created."""
    save = str(tmp_path / "out")
    rc, out, err = run_main(convert, *args, "--save", save)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1, (rc, out, err)
    assert not os.path.exists(save)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out")]  # no staging left
    return lines[0]


def rewrite_args(rank_file: str, **changes):
    sd = torch.load(rank_file, weights_only=False)
    for key, value in changes.items():
        setattr(sd["args"], key, value)
    torch.save(sd, rank_file)


def test_neither_format(tmp_path):
    src = tmp_path / "src"
    (src / "iter_0000003").mkdir(parents=True)
    (src / "latest_checkpointed_iteration.txt").write_text("3")
    line = fails(tmp_path, "from-megatron", "--load", str(src))
    assert "not a Megatron-LM checkpoint" in line and str(src) in line


def test_missing_tensor_parallel_rank_file(ours, tmp_path):
    src = to_megatron(ours, str(tmp_path / "src"), "--ckpt-format", "torch",
                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    os.remove(os.path.join(src, "release", "mp_rank_01_001", "model_optim_rng.pt"))
    line = fails(tmp_path, "from-megatron", "--load", src)
    assert "mp_rank_01_001/model_optim_rng.pt: missing" in line


@pytest.mark.parametrize("changes, words", [
    (dict(num_experts=8), "mixture of experts"),
    (dict(rotary_percent=0.5), "--rotary-percent 0.5"),
    (dict(multi_latent_attention=True), "multi-latent attention"),
    (dict(position_embedding_type="none", use_rotary_position_embeddings=False),
     "--position-embedding-type none"),
])
def test_architectures_not_built_here(ours, tmp_path, changes, words):
    src = to_megatron(ours, str(tmp_path / "src"), "--ckpt-format", "torch")
    rewrite_args(os.path.join(src, "release", "mp_rank_00", "model_optim_rng.pt"), **changes)
    line = fails(tmp_path, "from-megatron", "--load", src)
    assert words in line and "release" in line


def test_shapes_that_do_not_match_the_args(ours, tmp_path):
    src = to_megatron(ours, str(tmp_path / "src"), "--ckpt-format", "torch")
    rewrite_args(os.path.join(src, "release", "mp_rank_00", "model_optim_rng.pt"),
                 ffn_hidden_size=128)
    line = fails(tmp_path, "from-megatron", "--load", src)
    assert f"{src}/release: decoder.layers.0.mlp.linear_fc2.weight has shape (64, 96) but " \
           "the checkpoint's args give (64, 128)" in line


def test_torn_torch_dist_files(ours, tmp_path):
    src = to_megatron(ours, str(tmp_path / "src"))
    data = os.path.join(src, "release", "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    line = fails(tmp_path, "from-megatron", "--load", src)
    assert "corrupt or incomplete torch_dist checkpoint" in line


def test_sizes_megatron_cannot_split(ours, tmp_path):
    line = fails(tmp_path, "to-megatron", "--load", ours, "--tensor-model-parallel-size", "3")
    assert "--tensor-model-parallel-size: 3 does not divide the model's 4 attention heads" in line
    line = fails(tmp_path, "to-megatron", "--load", ours, "--pipeline-model-parallel-size", "3")
    assert "--pipeline-model-parallel-size: 3 does not divide the model's 4 layers" in line


def test_from_megatron_of_our_own_checkpoint(ours, tmp_path):
    line = fails(tmp_path, "from-megatron", "--load", ours)
    assert "not a Megatron-LM checkpoint" in line


# -- the trainer's flags ---------------------------------------------------------------------

RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "199",
       "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr",
       "1e-4", "--seq-length", "16", "--eval-iters", "0"]


def trainer_error(capsys, *args) -> str:
    import pretrain_gpt
    rc = pretrain_gpt.main([*RUN, *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1, err
    return lines[0]


def test_use_checkpoint_args_contradicted(ours, tmp_path, capsys):
    src = to_megatron(ours, str(tmp_path / "src"))
    line = trainer_error(capsys, "--load", src, "--use-checkpoint-args", "--hidden-size", "128")
    assert line == (f"error: --hidden-size: is 128 here but 64 in the Megatron-LM checkpoint "
                    f"{src}/release (--use-checkpoint-args): drop the flag or give the "
                    "checkpoint's value")
    line = trainer_error(capsys, "--use-checkpoint-args")
    assert "--use-checkpoint-args: needs --load" in line


def test_megatron_load_that_does_not_fit(ours, tmp_path, capsys):
    """A model flag that differs: the one line of any --load; the converted copy is gone."""
    src = to_megatron(ours, str(tmp_path / "src"), "--ckpt-format", "torch")
    save = tmp_path / "save"
    line = trainer_error(capsys, "--load", src, "--use-checkpoint-args", "--num-layers", "4",
                         "--untie-embeddings-and-output-weights", "--save", str(save),
                         "--no-swiglu", "--ffn-hidden-size", "96")
    assert "--swiglu: is False here but True in the Megatron-LM checkpoint" in line
    line = trainer_error(capsys, "--load", src, "--save", str(save))  # GPT-2 style defaults
    assert line.startswith(f"error: --load: {save}/.megatron_import_release/iter_0000000 was "
                           "saved with")
    assert os.listdir(save) == []  # the converted copy was removed


def test_exit_on_missing_checkpoint(tmp_path, capsys):
    own = str(tmp_path / "own")
    line = trainer_error(capsys, "--load", own, "--save", own, "--exit-on-missing-checkpoint")
    assert line == f"error: --exit-on-missing-checkpoint: --load {own} holds no checkpoint"


def test_use_checkpoint_args_on_a_first_job(tmp_path):
    """The same command line for a first job and its requeues: nothing to read yet, the
    flags given build the model (Megatron-LM's "using provided arguments"); the requeued
    job reads them back from the checkpoint the first one saved."""
    import pretrain_gpt
    own = str(tmp_path / "own")
    line = [*RUN, "--load", own, "--save", own, "--use-checkpoint-args", "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "2"]
    assert pretrain_gpt.main(line) == 0
    assert pretrain_gpt.main([*line[:line.index("--num-layers")], "--train-iters", "2"]) == 0
    from megaulysses.training.checkpoint import find_checkpoint, read_meta
    meta = read_meta(find_checkpoint(own))
    assert (meta["iteration"], meta["model"]["num_layers"], meta["model"]["hidden_size"]) == \
        (2, 2, 32)
