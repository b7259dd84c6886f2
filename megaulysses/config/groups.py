"""The --help groups, in the order --help lists them (schema.py, schema_rope.py and
schema_run.py file each section's flags under one)."""

MODEL, ROPE, MASK, DATA, TRAINING, PARALLEL, MEMORY, LOGGING, COMPAT = (
    "model", "RoPE scaling (at most one of llama3, linear, yarn; needs "
    "--position-embedding-type rope)", "attention mask (causal always; these narrow it)",
    "data", "training", "parallelism (data-parallel size = world / (tp*pp*sp*cp))",
    "activation memory (recomputation, tiling) and the memory plan", "logging",
    "Megatron-LM flags accepted with no effect here (each logged once, with the reason)")
GROUPS = (MODEL, ROPE, MASK, DATA, TRAINING, PARALLEL, MEMORY, LOGGING, COMPAT)
