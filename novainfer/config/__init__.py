"""Engine and server configuration, one module per job: model, cache, scheduler, parallel, speculative,
engine (the whole, built from flat keyword arguments) and server. Every engine setting is declared once, as a
field (config/fields.py `setting`); `LLM(**kwargs)` and the CLI's engine flags are derived from those fields."""

from novainfer.config.cache import CacheConfig
from novainfer.config.engine import EngineConfig, engine_arg_fields, resolve_cache_dtype
from novainfer.config.model import ModelConfig, to_torch_dtype
from novainfer.config.parallel import ParallelConfig, normalize_parallel_config
from novainfer.config.scheduler import SchedulerConfig
from novainfer.config.server import ServerConfig
from novainfer.config.speculative import SpeculativeConfig

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "engine_arg_fields",
    "normalize_parallel_config",
    "resolve_cache_dtype",
    "to_torch_dtype",
]
