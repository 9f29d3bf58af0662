"""The executor contract (what the engine needs from whatever runs the
model) and the choice of executor: in this process (``ModelRunner``), or
split over tensor-parallel workers (``TensorParallelExecutor``), or an
encoder's (``EncoderRunner``: no KV cache)."""
from typing import TYPE_CHECKING, Dict, Optional, Protocol, Sequence, Tuple, runtime_checkable

from pagedbackend.config import EngineConfig

if TYPE_CHECKING:
    import torch
    from pagedbackend.core.kv_groups import KVLayout
    from pagedbackend.lora.layers import LoRAModel

__all__ = ["Executor", "make_executor"]


@runtime_checkable
class Executor(Protocol):
    """What the engine reads from and asks of an executor; both executors
    implement every member."""
    # Cache geometry and KV layout.
    vocab_size: int
    hidden_size: int            # the final norm's width: an embedding's length
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    kv_layout: "KVLayout"       # the KV groups and their sliding windows (core.kv_groups)
    device: "torch.device"
    # Adapters: the adapted projections and their pool (None: enable_lora is off).
    lora: Optional["LoRAModel"]

    # One step and the block moves before it.
    # hidden_out: filled with the normed hidden rows (on the device) of entries with return_hidden
    # (pooling; ModelRunner only: runner=pooling serves on one rank).
    def execute_model(self, entries: Sequence, hidden_out: Optional[list] = None) -> "torch.Tensor": ...
    def copy_blocks(self, pairs: Sequence[Tuple[int, int]]) -> None: ...
    def swap_out(self, pairs: Sequence[Tuple[int, int]]) -> None: ...
    def swap_in(self, pairs: Sequence[Tuple[int, int]]) -> None: ...

    # Compile status.
    @property
    def compiled_step(self) -> bool: ...      # the compiled step serves
    def wait_for_compile(self, timeout: Optional[float] = None) -> bool: ...

    # Description and statistics.
    @property
    def cpu_contended(self) -> bool: ...      # other processes want our cores (cpu_wait)
    def describe(self) -> Dict[str, object]: ...   # linear and attention backends, native ops, LoRA kernel

    def shutdown(self) -> None: ...           # idempotent


def make_executor(config: EngineConfig, compile_in_background: bool = False) -> Executor:
    """A model runner for the engine (the same interface whatever the parallelism);
    ``compile_in_background``: see ``ModelRunner`` (a tensor-parallel step runs eager)."""
    import json
    from pagedbackend.models import ENCODER_MODEL_TYPES
    from pagedbackend.models.default_model import resolve_model_path
    hf_config = json.loads((resolve_model_path(config.model) / "config.json").read_text())
    if hf_config.get("model_type") in ENCODER_MODEL_TYPES:
        if config.tensor_parallel_size > 1:
            raise ValueError(f"an encoder ({hf_config['model_type']}) is served with tensor_parallel_size=1")
        from pagedbackend.worker.encoder_runner import EncoderRunner
        return EncoderRunner(config)
    if config.tensor_parallel_size > 1:
        from pagedbackend.worker.tp_executor import TensorParallelExecutor
        return TensorParallelExecutor(config)
    from pagedbackend.worker.model_runner import ModelRunner
    return ModelRunner(config, compile_in_background=compile_in_background)
