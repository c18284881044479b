"""deepinfer's scheduler: sequences, KV blocks with prefix caching, state slots, the
step-type vote of the seed, and the launch tensors of each step.

One step of the engine::

    out = sched.schedule()            # SchedulerOutputs: is_prompt, seqs, batch, ...
    token_ids = runner.execute(out)   # clone_blocks, zero_states, clone_states, forward
    finished = sched.update(out, token_ids)   # out.num_samples ids, sample order

``out``'s tensors are borrowed views of reused host buffers, valid until the next
``schedule()`` (see ``SchedulerOutputs``). Modules: ``config`` (SchedulerConfig,
EngineType), ``sequence``, ``block_manager`` (block pool + prefix cache),
``state_manager``, ``batch`` (numpy buffers -> torch), ``dp`` (votes), ``outputs``,
``scheduler``. Benchmark: ``python benchmarks/bench_scheduler.py``.

Imports neither ``kernels`` nor ``deepinfer``.
"""

from scheduler.batch import LaunchBatch
from scheduler.block_manager import BlockPool
from scheduler.config import EngineType, SchedulerConfig
from scheduler.outputs import SchedulerOutputs, SchedulerStats
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.state_manager import StateManager

__all__ = [
    "BlockPool",
    "EngineType",
    "LaunchBatch",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutputs",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "StateManager",
]
