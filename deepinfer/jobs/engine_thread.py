"""An engine stepped by a thread of its own, fed from other threads.

``LLMEngine`` is not thread-safe: one thread must make every call on it. A Ray Data
replica (``ray_stage``) answers several batches at once, each in a thread of Ray's, and
all of them share one engine so that its batch stays full across them. ``EngineThread``
owns the engine: callers ``submit`` requests from any thread and get a ``Future``; the
engine thread takes what was queued between two steps, steps while anything is
unfinished, and sleeps on the queue when nothing is.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future

from deepinfer.engine import LLMEngine
from deepinfer.jobs.input_records import JobRequest
from deepinfer.outputs import RequestOutput


class EngineThread:
    """``engine`` driven by a daemon thread. ``submit(req)`` -> ``Future`` of its
    ``RequestOutput``; a request the engine refuses (``ValueError`` at admission) fails
    its future with that error, alone. Should a step itself fail, every future in flight
    fails with that exception and the thread stops (``submit`` then raises it): the
    engine is in an unknown state, and its owner (a Ray replica) is restarted."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queue: queue.SimpleQueue[tuple[JobRequest, Future]] = queue.SimpleQueue()
        self._ids = itertools.count()  # engine ids: record ids may repeat across batches
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine",
                                        daemon=True)
        self._thread.start()

    def submit(self, req: JobRequest) -> Future:
        """Queue ``req`` (safe from any thread); its ``Future`` gets the output."""
        if self._failure is not None:
            raise RuntimeError("the engine thread stopped") from self._failure
        fut: Future = Future()
        self._queue.put((req, fut))
        return fut

    def _admit(self, req: JobRequest, fut: Future, waiting: dict[str, Future]) -> None:
        rid = f"{req.request_id}#{next(self._ids)}"
        try:
            self.engine.add_request(rid, req.prompt, req.prompt_token_ids, req.params,
                                    messages=req.messages,
                                    chat_template_kwargs=req.chat_template_kwargs,
                                    pooling=req.pooling, lora_request=req.lora_request)
        except ValueError as e:
            fut.set_exception(ValueError(str(e).replace(rid, req.request_id)))
            return
        waiting[rid] = fut

    def _run(self) -> None:
        waiting: dict[str, Future] = {}
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished()
                try:  # block only while there is nothing to step
                    item = self._queue.get_nowait() if busy else self._queue.get()
                except queue.Empty:
                    item = None
                while item is not None:
                    self._admit(*item, waiting)
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        item = None
                if engine.has_unfinished():
                    for res in engine.step():
                        fut = waiting.pop(res.request_id)
                        res.request_id = res.request_id.rsplit("#", 1)[0]
                        fut.set_result(res)
        except BaseException as e:  # noqa: BLE001 (handed to every waiting caller)
            self._failure = e
            for fut in waiting.values():
                fut.set_exception(e)
            while True:
                try:
                    _, fut = self._queue.get_nowait()
                except queue.Empty:
                    break
                fut.set_exception(e)


def result_of(fut: Future) -> RequestOutput | ValueError:
    """A submitted request's output, or the ``ValueError`` that refused it."""
    try:
        return fut.result()
    except ValueError as e:
        return e
