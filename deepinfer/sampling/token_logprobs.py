"""A step's logprobs, gathered on the device and read on the host only when the step's
result is (so that asking for logprobs does not make an overlapped step synchronous)."""

from __future__ import annotations

import numpy as np
import torch


class TokenLogprobs:
    """Per sample row: the sampled token's logprob and the top-``k`` (``k`` = the most any
    row asked for) of the raw logits, as device tensors until ``lists()``.

    - ``token_ids`` ``[N]`` int64 and ``sampled`` ``[N]`` float32: the sampled ids and
      their logprobs;
    - ``top_vals`` ``[N, k]`` float32 and ``top_ids`` ``[N, k]`` int64 (None when k = 0);
    - ``wanted`` host int64 ``[N]``: each row's own count (-1 = the row asked for none).

    ``copy_to_host()`` enqueues their copies into pinned memory on the current stream
    (the runner's copy stream, behind the event that ``result()`` waits for); ``lists()``
    then builds the dicts without a device sync. Without that copy ``lists()`` reads the
    tensors directly (a sync on CUDA; the plain path on a CPU)."""

    def __init__(self, token_ids: torch.Tensor, sampled: torch.Tensor,
                 top_vals: torch.Tensor | None, top_ids: torch.Tensor | None,
                 wanted: np.ndarray) -> None:
        self._tensors = [token_ids, sampled] + ([top_vals, top_ids] if top_vals is not None
                                                else [])
        self.wanted = wanted

    def copy_to_host(self) -> None:
        """Enqueue non-blocking copies of the tensors into pinned host memory on the
        current stream; the device tensors are marked used by it (``record_stream``) so
        the allocator keeps them until the copies ran."""
        stream = torch.cuda.current_stream()
        host = []
        for t in self._tensors:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            t.record_stream(stream)
            host.append(h)
        self._tensors = host

    def lists(self) -> list[dict[int, float] | None]:
        """Per row ``{token_id: logprob}`` (the sampled token first, then the row's top
        ones) or None for a row that asked for none. Call after the copy's event when
        ``copy_to_host()`` ran."""
        ids_l, sampled_l, *top = (t.tolist() for t in self._tensors)
        top_vals, top_ids = top if top else ([], [])
        out: list[dict[int, float] | None] = []
        for i, want in enumerate(self.wanted.tolist()):
            if want < 0:
                out.append(None)
                continue
            d = {ids_l[i]: sampled_l[i]}
            for j in range(min(want, len(top_ids[i]) if top_ids else 0)):
                d.setdefault(top_ids[i][j], top_vals[i][j])
            out.append(d)
        return out
