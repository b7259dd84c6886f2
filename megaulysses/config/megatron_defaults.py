"""Where a default here differs from Megatron-LM's, and why. Every other flag the two share
has Megatron-LM's default (megatron_args.json: its arguments.py as data), which
tests/test_megatron_defaults.py holds, so a Megatron-LM script means here what it means
there. The bundled run's own settings are a preset (presets.py), not defaults."""

from __future__ import annotations

_REQUIRED = ("Megatron-LM has no default (a script must give it); here the bundled run's "
             "value, so that a short command line still trains something")

DIFFERENT_DEFAULTS: dict[str, str] = {
    "--num-layers": _REQUIRED,
    "--hidden-size": _REQUIRED,
    "--num-attention-heads": _REQUIRED,
    "--seq-length": _REQUIRED,
    "--micro-batch-size": _REQUIRED,
    "--lr": _REQUIRED,
    "--tokenizer-type": "Megatron-LM has none; here the bundled SentencePiece tokenizer, or "
                        "GPT2BPETokenizer when --vocab-file and --merge-file are given (as "
                        "Megatron-LM's GPT-3 example expects)",
    "--tokenizer-model": "Megatron-LM has none; here the bundled SentencePiece model",
    "--split": "Megatron-LM's default None becomes its legacy '969, 30, 1' with a warning "
               "when --data-path is given; here the same split, without the warning",
    "--num-query-groups": "Megatron-LM's 1 counts only under --group-query-attention; here "
                          "the default is one group per head, and 1 under "
                          "--group-query-attention: the same models",
    "--num-workers": "Megatron-LM's 2; here 0: a batch is a few memory-mapped index lookups "
                     "built in milliseconds by the training process, and forked workers "
                     "only add processes (they are opt-in)",
    "--exit-signal-handler": "on under SLURM here (SIGTERM: finish the step, save, exit 0), "
                             "off elsewhere as in Megatron-LM",
    # Megatron-LM's None that it replaces by a value before use: that value here
    "--dataloader-type": "Megatron-LM's None becomes 'single' in its validate_args",
    "--yarn-beta-fast": "Megatron-LM's None becomes YarnRotaryEmbedding's 32.0 (its "
                        "_apply_yarn_config_from_args)",
    "--yarn-beta-slow": "Megatron-LM's None becomes YarnRotaryEmbedding's 1.0 (its "
                        "_apply_yarn_config_from_args)",
    "--eval-interval": "Megatron-LM's main has None ('no evaluation during training') but "
                       "then stops computing its validation sample count (train_iters // "
                       "eval_interval in train_valid_test_num_samples), so its scripts give "
                       "it; here 1000, its default up to 000c4ac2",
}
