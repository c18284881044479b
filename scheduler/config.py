"""Scheduler configuration and engine types."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from deepinfer_scheduler.util import cdiv


class EngineType(enum.IntEnum):
    """What kind of steps an engine takes (``docs/scheduling.md``, "Engine types").

    ``PROMPT``: prefill-only engine of a disaggregated pair (always a prompt step).
    ``COMPLETION``: decode-only engine (always a decode step).
    ``NORMAL``: prompt and decode steps, chosen by a DP-wide vote.
    """

    PROMPT = 0
    COMPLETION = 1
    NORMAL = 2


@dataclass
class SchedulerConfig:
    """Static limits of one rank's scheduler.

    ``num_blocks`` KV blocks of ``block_size`` tokens; ``max_num_seqs`` state slots (at most
    that many live sequences); at most ``max_num_batched_tokens`` tokens per step.
    ``prefill_attempt_interval`` / ``prefill_any_attempt_interval``: decode steps between
    ALL / ANY prefill votes (see ``scheduler.step_type``). ``prefill_watermark``: a rank
    only wants a prompt step while ``cache_usage() <= prefill_watermark``. ``device``:
    where the engine runs; host launch buffers are pinned and DP votes travel on the GPU
    when it starts with ``"cuda"``.
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    # Every decode step is an ALL point by default: a lone rank prefills as soon as it has
    # work; in DP that needs every rank to want it, and the ANY points bound how long an
    # isolated rank's prompt waits.
    prefill_attempt_interval: int = 1
    prefill_any_attempt_interval: int = 8
    prefill_watermark: float = 0.95
    engine_type: EngineType = EngineType.NORMAL
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    device: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.engine_type, str):
            try:
                self.engine_type = EngineType[self.engine_type.upper()]
            except KeyError:
                raise ValueError(
                    f"engine_type={self.engine_type!r}: expected PROMPT, COMPLETION or NORMAL"
                ) from None
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "prefill_attempt_interval",
                     "prefill_any_attempt_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        wm = self.prefill_watermark
        if isinstance(wm, bool) or not isinstance(wm, (int, float)) or not 0.0 <= wm <= 1.0:
            raise ValueError(f"prefill_watermark={wm!r}: must be a number in [0, 1]")
        if not isinstance(self.engine_type, EngineType):
            try:
                self.engine_type = EngineType(self.engine_type)
            except ValueError:
                raise ValueError(f"engine_type={self.engine_type!r}: not an EngineType") from None
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device={self.device!r}: must be a device string such as 'cpu'")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt (or a preempted sequence's recompute) has to
            # fit in one step's token budget.
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} when enable_chunked_prefill is False"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block-table row: blocks of the longest possible sequence."""
        return cdiv(self.max_model_len, self.block_size)
