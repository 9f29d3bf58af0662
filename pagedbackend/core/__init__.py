"""Memory management and scheduling, without tensors: the block pool and prefix
cache, the block manager (block tables, fork, copy-on-write, swap), sequences,
and the scheduler that owns the block manager."""
from .block_manager import AllocStatus, BlockManager
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput, StepUpdate
from .sequence import GroupStatus, RequestMetrics, Sequence, SequenceGroup

__all__ = ["AllocStatus", "BlockManager", "GroupStatus", "RequestMetrics", "ScheduledSeq",
           "Scheduler", "SchedulerOutput", "Sequence", "SequenceGroup", "StepUpdate"]
