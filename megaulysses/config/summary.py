"""Every resolved setting of a run, one per line, as Megatron-LM prints its arguments at
start (`  name ........ value`, sorted, under Megatron-LM's argument names where it has one:
the flag's own name, or the field's `megatron` name), so a user sees what a script means
before anything runs. The trainer logs it (rank 0); --dry-run prints it."""

from __future__ import annotations

from dataclasses import Field, fields
from typing import Any

from megaulysses.config.presets import preset_lines
from megaulysses.config.resolve import RunConfig
from megaulysses.config.schema import SECTIONS

WIDTH = 48  # the column the values start in, as Megatron-LM's


def _name(f: Field) -> str:
    """Megatron-LM's argument name for a field: its `megatron` name, else the flag's."""
    flags = f.metadata.get("flags")
    if not flags:
        return f.name
    main = flags[f.metadata["main"]]
    if main.megatron:
        return main.megatron.lstrip("-").replace("-", "_")
    return (main.names[0] if main.names else f.name).lstrip("-").replace("-", "_")


def settings(cfg: RunConfig) -> dict[str, Any]:
    """{argument name: resolved value}: every flag's field, and what Megatron-LM derives."""
    rows: dict[str, Any] = {}
    for section, (cls, _) in SECTIONS.items():
        for f in fields(cls):
            if f.metadata.get("flags"):
                rows[_name(f)] = getattr(getattr(cfg, section), f.name)
    m, d = cfg.model, cfg.dims
    rows.update(group_query_attention=m.num_query_groups is not None,
                padded_vocab_size=m.padded_vocab_size, ffn_hidden_size=m.ffn_size,
                kv_channels=m.head_dim, max_position_embeddings=m.max_positions,
                world_size=d.world, data_parallel_size=d.dp,
                num_micro_batches=cfg.micro_batches, preset=cfg.preset)
    return rows


def format_settings(cfg: RunConfig) -> str:
    lines = preset_lines(cfg) + ["------------------------ arguments ------------------------"]
    for name, value in sorted(settings(cfg).items()):
        lines.append(f"  {name} {'.' * max(2, WIDTH - len(name))} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
