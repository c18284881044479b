"""Async scheduling over a simulated device for ``bench_host.py``: decode steps/s with
``async_scheduling`` on and off when the forward takes a fixed D ms on a device that runs
asynchronously, as a GPU does, while the host part of each step stays real."""

from __future__ import annotations

import time

from host_fixtures import engine_arg_names, make_llm, median, model_of, random_prompts, zero_forward


class _SimulatedDevice:
    """A device that takes ``delay`` seconds a step and runs asynchronously, as a GPU
    does: the model's forward returns zeros at once (no CPU work), and each launched
    step's sampled ids become ready ``delay`` after the device is free to start it
    (steps queue behind each other). ``result()`` on the step's handle sleeps until then.
    The host part of a step (scheduling, launch tensors, sampling, update) stays real, so
    with ``async_scheduling`` off a step costs host + D, with it on ideally max(host, D).
    """

    def __init__(self, engine, delay: float) -> None:
        self.runner = engine.runner
        self.delay = delay
        self.seconds, self.calls = 0.0, 0
        self.free_at = 0.0
        self.launches: list[tuple[float, bool, int]] = []  # (time, decode?, samples)
        launch = self.runner.launch

        def delayed_launch(out, *args, **kwargs):
            self.launches.append((time.perf_counter(), not out.is_prompt, out.num_samples))
            handle = launch(out, *args, **kwargs)
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + self.delay
            self.seconds += self.delay
            self.calls += 1
            return _ReadyAt(handle, self.free_at)

        self._zero = zero_forward(model_of(engine))
        self._zero.__enter__()
        self.runner.launch = delayed_launch

    def remove(self) -> None:
        self._zero.__exit__(None, None, None)
        del self.runner.launch


class _ReadyAt:
    """A launched step's handle whose ids are ready at ``ready_at`` (perf_counter)."""

    def __init__(self, handle, ready_at: float) -> None:
        self.handle, self.ready_at = handle, ready_at

    def finish_sampling(self) -> None:
        self.handle.finish_sampling()

    def result(self):
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.handle.result()


def run_overlap(model_dir: str, num_seqs: int, delay_ms: float, steps: int,
                reps: int) -> dict:
    """Decode step time with async_scheduling off and on over the simulated device.

    A step's time is the interval between two consecutive launches of full-batch decode
    steps (the loop's period in steady state), median over every such interval of
    ``reps`` runs of ``num_seqs`` prompts x ``steps`` tokens. Off, it is host + D; the
    host part of a step is that minus D. The whole runs' wall times are reported too:
    they also hold the prompt steps and the end of the run (texts decoded once at the
    end), which no device work hides."""
    if "async_scheduling" not in engine_arg_names():
        return {"skipped": "async_scheduling not implemented"}
    from deepinfer import SamplingParams

    out: dict = {"num_seqs": num_seqs, "device_ms": delay_ms, "steps": steps}
    runs = {}
    for flag in (False, True):
        llm = make_llm(model_dir, num_seqs, steps, async_scheduling=flag)
        vocab = llm.engine.model_config.vocab_size
        dev = _SimulatedDevice(llm.engine, delay_ms / 1e3)
        try:
            llm.generate(random_prompts(4, vocab, 7), SamplingParams(max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
            intervals, walls = [], []
            for rep in range(reps):
                dev.launches.clear()
                sp = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
                t0 = time.perf_counter()
                llm.generate(random_prompts(num_seqs, vocab, 100 * rep + 1), sp, use_tqdm=False)
                walls.append(time.perf_counter() - t0)
                full = [t for t, decode, n in dev.launches if decode and n == num_seqs]
                intervals += [b - a for a, b in zip(full, full[1:])]
        finally:
            dev.remove()
        runs[flag] = (median(intervals), median(walls))
    (off, wall_off), (on, wall_on) = runs[False], runs[True]
    dev_s = delay_ms / 1e3
    host = off - dev_s
    bound = max(host, dev_s)
    out.update(off_ms=off * 1e3, on_ms=on * 1e3, host_ms=host * 1e3,
               device_measured_ms=delay_ms, off_steps_per_s=1 / off,
               on_steps_per_s=1 / on, on_vs_max_host_device=on / bound,
               target_met=on <= 1.1 * bound, wall_off_s=wall_off, wall_on_s=wall_on)
    return out


def overlap_line(o: dict) -> str:
    """The overlap result (``run_overlap``'s dict) as one line of the report."""
    if "skipped" in o:
        return f"overlap: skipped: {o['skipped']}"
    return (f"overlap ({o['num_seqs']} seqs, simulated device D = {o['device_ms']:g} ms, "
            "step = interval between full-batch decode launches, median): async off "
            f"{o['off_steps_per_s']:.1f} steps/s ({o['off_ms']:.2f} ms), on "
            f"{o['on_steps_per_s']:.1f} steps/s ({o['on_ms']:.2f} ms); host "
            f"{o['host_ms']:.2f} ms; on / max(host, D) = {o['on_vs_max_host_device']:.2f} "
            f"(target <= 1.10: {'met' if o['target_met'] else 'not met'}); whole runs of "
            f"{o['steps']} tokens: off {o['wall_off_s']:.2f} s, on {o['wall_on_s']:.2f} s")
