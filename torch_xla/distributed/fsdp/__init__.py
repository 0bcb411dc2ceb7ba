from .xla_fully_sharded_data_parallel import XlaFullyShardedDataParallel
from .state_dict_utils import (consolidate_sharded_state_dicts,
                               consolidate_sharded_model_checkpoints)
from .utils import checkpoint_module

__all__ = [
    "XlaFullyShardedDataParallel",
    "consolidate_sharded_state_dicts",
    "consolidate_sharded_model_checkpoints",
    "checkpoint_module",
]
