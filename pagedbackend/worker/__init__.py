"""The device side: the model runner (weights, KV cache, one forward per step),
the flat batch and its attention metadata, and the executors that run it in
this process or split over tensor-parallel ranks (``tp_protocol``,
``tp_executor``, ``tp_worker``)."""
from pagedbackend.worker.batch import SeqEntry, StepBatch
from pagedbackend.worker.executor import make_executor

__all__ = ["SeqEntry", "StepBatch", "make_executor"]
