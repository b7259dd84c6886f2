"""Megatron-LM's checkpoints in and out (both formats, any tensor/pipeline sizes).

    read_megatron(path)            a Megatron-LM save or iter_* directory -> our model
    import_megatron(path, save)    ... written as our checkpoint (trainer_state.json says
                                   where it came from; the iteration, consumed samples and
                                   LR schedule carry over)
    export_megatron(...)           our model -> Megatron-LM's torch_dist or torch format
    is_megatron(path)              whether --load names a Megatron-LM checkpoint
    import_for_run(...)            the trainer's --load of one: converted by rank 0 into
                                   a directory every rank reads (remove_import after)
"""

from megaulysses.training.megatron.convert import (export_megatron, import_for_run,
                                                   import_megatron, is_megatron, not_carried,
                                                   remove_import)
from megaulysses.training.megatron.read import MegatronCheckpoint, read_megatron

__all__ = ["MegatronCheckpoint", "export_megatron", "import_for_run", "import_megatron",
           "is_megatron", "not_carried", "read_megatron", "remove_import"]
