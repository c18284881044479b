"""Step type: does this step prefill or decode? (``docs/scheduling.md``, "Step type").

PROMPT engines always prefill and COMPLETION engines always decode. A NORMAL engine
votes with the other ranks of its DP group, because every rank of the group must take a
step of the same type: at ALL points prefill only if every rank wants to, at ANY points
if one rank does, and then a second vote checks that some rank actually scheduled a
prefill. ``decode_step`` is equal on every rank, so all ranks vote at the same points
and no all-reduce waits for a rank that does not join it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

from deepinfer_scheduler.config import EngineType, SchedulerConfig
from deepinfer_scheduler.outputs import SchedulerOutputs


class Voter(Protocol):
    """What the step-type votes need: ``scheduler.dp.DPVoter``, or a test's fake."""

    def allreduce_min(self, value: int) -> int: ...


class VotePoint(enum.Enum):
    ALL = "all"  # prefill only if every rank wants to
    ANY = "any"  # prefill if any rank wants to


def vote_point(decode_step: int, config: SchedulerConfig) -> VotePoint | None:
    """The kind of vote at ``decode_step`` (decode steps since the last prompt step), or
    None (decode without voting). ANY wins where both kinds fall on the same step."""
    d = decode_step
    if d != 0 and d % config.prefill_any_attempt_interval == 0:
        return VotePoint.ANY
    if d % config.prefill_attempt_interval == 0:
        return VotePoint.ALL
    return None


def wants_prefill(cache_usage: float, watermark: float, has_waiting: bool,
                  has_running: bool) -> bool:
    """Whether this rank wants a prompt step: work is waiting and the cache is at most
    ``watermark`` full. Deviation, for liveness only: with nothing running no decode
    can ever lower the usage (a cut prompt may hold blocks), so the watermark is
    waived."""
    return has_waiting and (cache_usage <= watermark or not has_running)


def choose_step(config: SchedulerConfig, decode_step: int, voter: Voter, *,
                want: Callable[[], bool],
                prefill: Callable[[], SchedulerOutputs | None],
                decode: Callable[[], SchedulerOutputs],
                empty_prompt: Callable[[], SchedulerOutputs]) -> SchedulerOutputs:
    """This step's outputs. ``want``: this rank's wish to prefill (asked only at vote
    points); ``prefill``: schedule a prompt step, None if nothing fits; ``decode``:
    schedule a decode step; ``empty_prompt``: a prompt step with nothing in it."""
    et = config.engine_type
    if et is EngineType.PROMPT:
        # Prefill-only engine: a prefill result even if nothing was scheduled.
        out = prefill()
        return out if out is not None else empty_prompt()
    if et is EngineType.COMPLETION:
        return decode()
    point = vote_point(decode_step, config)
    if point is None:
        return decode()
    wanted = want()
    vote = voter.allreduce_min
    if point is VotePoint.ANY:
        do_prefill = vote(0 if wanted else 1) == 0  # one rank wanting is enough
    else:
        do_prefill = vote(1 if wanted else 0) == 1  # every rank must want
    if not do_prefill:
        return decode()
    out = prefill() if wanted else None
    # Prefill can still come back empty (no slot, no blocks). If it did on every rank,
    # decode: an empty prompt step would reset decode_step and vote again, forever,
    # while running is full and waiting is not empty.
    if vote(0 if out is not None else 1) != 0:
        return decode()
    if out is not None:
        return out
    return empty_prompt()  # another rank prefills: keep the step types equal
