"""The progress bar of a generation run: requests done, prompt and generation tok/s."""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm


class RunProgress:
    """A tqdm bar over ``total`` requests whose postfix shows token rates since it began.
    ``disable``: no bar at all (``--no-progress``, or a rank other than 0)."""

    def __init__(self, total: int, desc: str = "generate", disable: bool = False,
                 stderr: bool = True) -> None:
        self.bar = tqdm(total=total, desc=desc, unit="req", disable=disable,
                        dynamic_ncols=True, file=sys.stderr if stderr else None)
        self.start = time.perf_counter()

    def update(self, done: int, prompt_tokens: int, generated_tokens: int) -> None:
        """Move to ``done`` finished requests; rates from the token counts so far."""
        if self.bar.disable:
            return
        self.bar.update(done - self.bar.n)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"in {prompt_tokens / elapsed:.0f} tok/s, "
                                 f"out {generated_tokens / elapsed:.0f} tok/s", refresh=False)

    def elapsed(self) -> float:
        """Seconds since the bar began."""
        return time.perf_counter() - self.start

    def close(self) -> None:
        self.bar.close()
