"""deepinfer's scheduler: sequences, KV blocks with prefix caching, state slots, the
step-type votes, and the launch tensors of each step. The semantics it implements are
described in ``docs/scheduling.md``.

One step of the engine::

    out = sched.schedule()            # SchedulerOutputs: is_prompt, seqs, batch, ...
    token_ids = runner.execute(out)   # clone_blocks, zero_states, clone_states, forward
    finished = sched.update(out, token_ids)   # out.num_samples ids, sample order

``out``'s tensors are borrowed views of reused host buffers, valid until the next
``schedule()`` (see ``SchedulerOutputs``). Modules, one concept each:

- ``scheduler``: the policy (queues, preemption, ``schedule`` / ``update``)
- ``step_type``: prompt or decode step (ALL/ANY vote points, the two DP votes);
  ``dp``: the all-reduce they go through
- ``admission``: packing a prompt step (slots, blocks, prefix hits, chunking, forks)
- ``kv_cache``: block-table rows (the one copy), copy-on-write, prefix-cache hashing,
  capacity; ``block_manager``: the ref-counted block pool and cache map
- ``state_manager``: state slots and their per-slot host rows
- ``batch``: launch buffers and the prompt / decode batches
- ``decode_plan``: a decode step's rows, blocks and slot mapping; ``decode_cursor``: the
  same derived from the last step when the rows did not change (steady decode);
  ``running_rows``: the per-row values fixed while the running list is
- ``samples``: applying sampled tokens (stop, length, registration)
- ``handoff``: export / import of prefilled sequences (disaggregated prefill/decode)
- ``registry``: request validation, live sequences by id and request
- ``sequence``, ``outputs``, ``config``, ``util`` (``cdiv``)

Benchmark: ``python benchmarks/bench_scheduler.py``. Imports neither ``kernels`` nor
``deepinfer``.
"""

from deepinfer_scheduler.batch import LaunchBatch
from deepinfer_scheduler.block_manager import BlockPool
from deepinfer_scheduler.config import EngineType, SchedulerConfig
from deepinfer_scheduler.outputs import SchedulerOutputs, SchedulerStats
from deepinfer_scheduler.scheduler import Scheduler
from deepinfer_scheduler.sequence import Sequence, SequenceStatus
from deepinfer_scheduler.state_manager import StateManager

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
