"""Which decoder layers a config marks: the ``layer_types`` list transformers writes, and
the periodic patterns configs and llama.cpp derive it from (``sliding_window_pattern``,
``no_rope_layer_interval``)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["all_but_every_nth", "every_nth", "sliding_layers_of"]


def sliding_layers_of(types: Sequence[str]) -> tuple[int, ...]:
    """The layers ``layer_types`` marks ``"sliding_attention"``."""
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def every_nth(num_layers: int, period: int) -> tuple[int, ...]:
    """Each ``period``-th of ``num_layers`` layers: ``i`` with ``(i + 1) % period == 0``
    (``period`` >= 1)."""
    return tuple(i for i in range(num_layers) if (i + 1) % period == 0)


def all_but_every_nth(num_layers: int, period: int) -> tuple[int, ...]:
    """The layers :func:`every_nth` leaves out (``period`` 0: all of them, as llama.cpp
    reads a sliding-window pattern of 0)."""
    if period == 0:
        return tuple(range(num_layers))
    nth = set(every_nth(num_layers, period))
    return tuple(i for i in range(num_layers) if i not in nth)
