"""The run's configuration: one schema (schema.py: frozen dataclasses, each field declared
once with its flag), the command line generated from it (cli.py), the rules (rules.py), the
grid's sizes (grid.py), and resolve() (resolve.py), which completes a parsed Config into
the frozen RunConfig that the trainer, --dry-run, the planner and the converter start
from. No torch is imported here.
"""

from megaulysses.config.cli import build_parser, finite_float, parse_args, positive_int
from megaulysses.config.errors import CheckpointError, ConfigError, TrainingError
from megaulysses.config.grid import CP, DP, DP_SP, MESH_DIMS, PP, SP, TP, ParallelDims
from megaulysses.config.resolve import RunConfig, resolve
from megaulysses.config.rules import check_grid, check_ring, pipeline_layout, validate
from megaulysses.config.schema import (BUNDLED_DATA, BUNDLED_TOKENIZER, MASK_FIELDS, REPO_ROOT,
                                       Config, DataConfig, LogConfig, MemoryConfig, ModelConfig,
                                       ParallelConfig, TrainConfig)

__all__ = ["BUNDLED_DATA", "BUNDLED_TOKENIZER", "CP", "DP", "DP_SP", "MASK_FIELDS", "MESH_DIMS",
           "PP", "REPO_ROOT", "SP", "TP", "CheckpointError", "Config", "ConfigError",
           "DataConfig", "LogConfig", "MemoryConfig", "ModelConfig", "ParallelConfig",
           "ParallelDims", "RunConfig", "TrainConfig", "TrainingError", "build_parser",
           "check_grid", "check_ring", "finite_float", "parse_args", "pipeline_layout",
           "positive_int", "resolve", "validate"]
