"""Chooses how the model runs: in this process, or split over tensor-parallel workers."""
from pagedbackend.config import EngineConfig


def make_executor(config: EngineConfig, compile_in_background: bool = False):
    """A model runner for the engine (the same interface whatever the parallelism);
    ``compile_in_background``: see ``ModelRunner`` (a tensor-parallel step runs eager)."""
    if config.tensor_parallel_size > 1:
        from pagedbackend.worker.tp_executor import TensorParallelExecutor
        return TensorParallelExecutor(config)
    from pagedbackend.worker.model_runner import ModelRunner
    return ModelRunner(config, compile_in_background=compile_in_background)
