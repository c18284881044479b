"""Structured-output cases on the tiny random checkpoints, shared by the CPU engine tests
(``test_structured_output.py``) and the CUDA ones (``test_cuda_engine.py``)."""

from __future__ import annotations

from deepinfer import SamplingParams, StructuredOutputsParams

SO = StructuredOutputsParams

TINY_PROMPTS = ["the quick brown fox jumps over the lazy dog", "once upon a time",
                "hello world, hello engine", "a b c d e f g h i j k l m n o p",
                "numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]

TINY_SCHEMA = {
    "type": "object",
    "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 999},
                   "s": {"type": "string", "maxLength": 6},
                   "e": {"enum": ["a", "b"]}},
    "required": ["k", "s", "e"],
}


def tiny_params() -> list[SamplingParams]:
    """One per ``TINY_PROMPTS``: JSON (greedy, n=2; seeded), regex (seeded, n=2), an
    unconstrained neighbour, and a choice under ``ignore_eos``."""
    return [
        SamplingParams(temperature=0.0, max_tokens=60, n=2,
                       structured_outputs=SO(json=TINY_SCHEMA)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, n=2,
                       structured_outputs=SO(regex="[a-e]{12,20}")),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=8, max_tokens=60,
                       structured_outputs=SO(json=TINY_SCHEMA)),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                       structured_outputs=SO(choice=["left", "right"])),
    ]


def record_overlap(engine) -> list[tuple[int, bool]]:
    """Spy on an engine's loop: for each launched step, (steps still in flight when it
    was launched, whether its sampling was deferred for a mask)."""
    events: list[tuple[int, bool]] = []
    launch, complete = engine._launch, engine._complete
    open_steps = [0]

    def spy_launch():
        step = launch()
        events.append((open_steps[0], step[1].sampling_pending))
        open_steps[0] += 1
        return step

    def spy_complete(*step):
        open_steps[0] -= 1
        return complete(*step)

    engine._launch, engine._complete = spy_launch, spy_complete
    return events
