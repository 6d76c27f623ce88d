"""The one thread that runs the model for ``tsspec serve``: it admits queued requests up to
``parallel``, gives each its own cache and speculation plan, steps every admitted sequence together
(their rows share one trunk forward, ``spec.loop.step_together``) and settles each request's future
when its run ends. ``Metrics`` counts what it served for ``/metrics``.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..generate import TextGeneration
from ..sampling import Sampler
from ..spec.loop import step_together
from .requests import APIError

if TYPE_CHECKING:
    from .service import Server


@dataclass
class Metrics:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_calls: int = 0
    decode_ms: float = 0.0
    steps: int = 0  # scheduler steps
    shared_steps: int = 0  # of those, steps in which several sequences shared the forward

    def prometheus(self) -> str:
        rows = [
            ("tsspec_requests_total", "counter", "completions served", self.requests),
            ("tsspec_request_errors_total", "counter", "requests answered with an error", self.errors),
            ("tsspec_prompt_tokens_total", "counter", "prompt tokens of served completions", self.prompt_tokens),
            ("tsspec_prompt_tokens_reused_total", "counter", "prompt tokens taken from the prefix cache",
             self.reused_tokens),
            ("tsspec_generated_tokens_total", "counter", "tokens generated", self.generated_tokens),
            ("tsspec_spec_drafted_tokens_total", "counter", "draft tokens sent to verification", self.drafted),
            ("tsspec_spec_accepted_tokens_total", "counter", "draft tokens accepted", self.accepted),
            ("tsspec_spec_verify_calls_total", "counter", "verify forwards", self.verify_calls),
            ("tsspec_decode_seconds_total", "counter", "time spent decoding", self.decode_ms / 1000.0),
            ("tsspec_steps_total", "counter", "decoding steps of the scheduler", self.steps),
            ("tsspec_shared_steps_total", "counter", "steps that stepped several sequences together (their rows "
             "in one forward where the trunk batches sequences)",
             self.shared_steps),
        ]
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
        return "\n".join(out) + "\n"


@dataclass
class Job:
    """One request on its way through the scheduler; ``future`` ends with (result, prompt tokens
    reused) or the error."""

    prompt: list[int]
    sampler: Sampler
    max_tokens: int
    stop: list[str]
    on_text: Callable[[str], None] | None = None
    interrupted: Callable[[], bool] | None = None
    future: Future = field(default_factory=Future)
    gen: TextGeneration | None = None
    cache: Any = None
    reused: int = 0

    def gone(self) -> bool:
        """Its client left: a stream's consumer went away, or the awaiting handler was cancelled
        (which cancels ``future``)."""
        return self.future.cancelled() or (self.interrupted is not None and self.interrupted())

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        """End ``future``, unless a departed client's cancel got there first."""
        if self.future.done():
            return
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)
        except InvalidStateError:  # cancelled between the check and the set
            pass


class Scheduler:
    """The one thread that runs the model: admits waiting jobs up to ``parallel``, steps every
    admitted one together, and settles each job's future when its run ends."""

    def __init__(self, server: "Server", parallel: int, queue_bound: int):
        if parallel < 1 or queue_bound < 0:
            raise ValueError("parallel must be >= 1 and the queue bound >= 0")
        self.server = server
        self.parallel = parallel
        self.queue_bound = queue_bound
        self.cv = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []  # the scheduler thread's own
        self._thread: threading.Thread | None = None  # ``run``'s caller, or started by the first request
        self._stop = threading.Event()

    def submit(self, job: Job) -> None:
        """Queue ``job``, or refuse it (503) when the queue is full."""
        with self.cv:
            if self._stop.is_set():
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if len(self.waiting) >= self.queue_bound + max(0, self.parallel - len(self.active)):
                raise APIError(503, f"the server is busy ({self.parallel} requests running, {len(self.waiting)} "
                               "waiting); retry later", type="server_error", code="server_busy")
            self.waiting.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tsspec-scheduler", daemon=True)
                self._thread.start()
            self.cv.notify()

    def load(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self.cv:
            return len(self.active), len(self.waiting)

    def run(self) -> None:
        """Be the scheduler on the calling thread until ``stop`` (from any thread), then answer every
        request still running or waiting with 503.

        ``tsspec serve`` calls this on its main thread, the one that loaded the model. The kernels'
        OpenMP runtime (libgomp) gives every thread that starts a parallel region its own team of
        workers, and once it manages more threads than there are CPUs it stops letting idle workers
        spin between regions, so each of a forward's hundreds of regions waits for workers to wake:
        a qwen2.5-coder-0.5b decode step stepped from a second thread ran at about 0.65x the speed
        of the same step on the thread that loaded the model (45 vs 66-70 tok/s)."""
        with self.cv:
            if self._thread is not None:
                raise RuntimeError("the scheduler is already running")
            self._thread = threading.current_thread()
        try:
            self._loop()
        finally:
            self._drain(APIError(503, "the server is shutting down", type="server_error", code="shutting_down"))

    def stop(self) -> None:
        """Make ``run`` return (its loop checks between steps)."""
        with self.cv:
            self._stop.set()
            self.cv.notify_all()

    def _drain(self, error: APIError) -> None:
        with self.cv:
            jobs = self.active + list(self.waiting)
            self.active, self.waiting = [], deque()
        for job in jobs:
            job.cache = None  # the process is ending: no kept cache to give back
            job.settle(error=error)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.cv:
                while not self.waiting and not self.active:
                    if self._stop.is_set():
                        return
                    self.cv.wait()
                admit = []
                while self.waiting and len(self.active) + len(admit) < self.parallel:
                    admit.append(self.waiting.popleft())
            for i, job in enumerate(admit):
                try:
                    self._admit(job)
                except KeyboardInterrupt:  # the rest are answered by ``run``'s drain, with those waiting
                    with self.cv:
                        self.waiting.extendleft(reversed([j for j in admit[i:] if j not in self.active]))
                    raise
            live = [j for j in self.active if not j.gen.run.done]
            if live:
                try:
                    step_together([j.gen.run for j in live])
                    self.server.metrics.steps += 1
                    self.server.metrics.shared_steps += len(live) > 1
                except KeyboardInterrupt:  # the server is stopping: ``run`` answers them all with 503
                    raise
                except BaseException as e:  # noqa: BLE001 - every sequence of the step is answered
                    for j in live:
                        self._fail(j, e)
            for j in [j for j in self.active if j.gen.run.done]:
                self._retire(j)

    def _admit(self, job: Job) -> None:
        """Take a kept cache and build the job's sequence (its own speculator and governor); its
        prefill runs in the following steps, beside the other sequences' rows."""
        srv = self.server
        if job.gone():  # its client left while it waited
            job.settle(error=APIError(499, "the client went away", code="client_gone"))
            return
        job.cache, job.reused = srv.prefix.take(job.prompt)
        try:
            job.gen = srv.engine.begin(job.prompt, sampler=job.sampler, max_tokens=job.max_tokens, cache=job.cache,
                                       stop=job.stop, on_text=job.on_text, interrupted=job.gone,
                                       plan=srv.new_plan())
            self.active.append(job)
            job.gen.run.begin()  # its prompt's chunks share the next steps' forwards
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e)

    def _fail(self, job: Job, e: BaseException) -> None:
        if job in self.active:
            self.active.remove(job)
        if job.cache is not None:  # the cache may be mid-forward: give its memory back empty
            job.cache.reset()
            self.server.prefix.give([], job.cache)
            job.cache = None
        job.settle(error=e)

    def _retire(self, job: Job) -> None:
        self.active.remove(job)
        try:
            result = job.gen.result()
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e)
            return
        srv = self.server
        srv.prefix.give(job.prompt + result.generated_ids, job.cache, len(job.prompt))
        job.cache = None
        m, s = srv.metrics, result.stats
        m.requests += 1
        m.prompt_tokens += len(job.prompt)
        m.reused_tokens += job.reused
        m.generated_tokens += len(result.token_ids)
        m.drafted += s.drafted
        m.accepted += s.accepted
        m.verify_calls += s.verify_calls
        m.decode_ms += s.decode_ms
        job.settle((result, job.reused))
