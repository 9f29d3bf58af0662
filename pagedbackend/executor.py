"""Chooses how the model runs: in this process, or split over tensor-parallel workers."""
from .config import EngineConfig


def make_executor(config: EngineConfig):
    """A model runner for the engine (the same interface whatever the parallelism)."""
    if config.tensor_parallel_size > 1:
        from .parallel import TensorParallelExecutor
        return TensorParallelExecutor(config)
    from .model_runner import ModelRunner
    return ModelRunner(config)
