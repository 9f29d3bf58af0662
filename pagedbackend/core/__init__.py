"""Memory management and scheduling, without tensors: the block pool and prefix
cache, the block manager (block tables, fork, copy-on-write, swap), sequences,
and the scheduler that owns the block manager."""
from .block_manager import AllocStatus, BlockManager
from .scheduled import ScheduledSeq, SchedulerOutput, SeqEntry, StepUpdate
from .scheduler import Scheduler
from .sequence import GroupStatus, RequestMetrics, Sequence, SequenceGroup

__all__ = ["AllocStatus", "BlockManager", "GroupStatus", "RequestMetrics", "ScheduledSeq",
           "Scheduler", "SchedulerOutput", "SeqEntry", "Sequence", "SequenceGroup", "StepUpdate"]
