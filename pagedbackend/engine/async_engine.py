"""The online engine: the core's step loop runs in a background thread, the
output processor (text, stop strings, log-probabilities, deltas) in a second
one fed by a queue, off the step; requests come in from any thread and their
output deltas stream back through ``RequestStream``. The sequences that stop
strings end go back to the engine thread, which frees them before its next
step.

The engine is built in the thread that steps it. With OpenMP (torch's CPU
kernels), each thread that runs a parallel region gets a team of threads of
its own, kept until that thread ends: an engine loaded and warmed up in one
thread and stepped in another leaves two teams, more threads than cores, and
libgomp then makes the working team's threads sleep between parallel regions
instead of spinning. Each of the hundreds of regions of a step pays for a
wake-up, so steps are slower that way than built and stepped in one thread
(BENCHMARKS.md, "served step").
"""
import asyncio
import logging
import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from ..config import EngineConfig
from .core_outputs import SeqFinish
from .llm_engine import LLMEngine, Prompt
from .pooling import RequestParams
from .outputs import CompletionOutput, EngineStats, RequestOutput
from ..sampling_params import InvalidRequestError
from ..core.sequence import SequenceGroup
from ..lora import LoRARequest

_END = object()
IDLE_STATS_S = 0.5   # how often an idle engine refreshes its statistics
logger = logging.getLogger("pagedbackend")


class EngineDeadError(RuntimeError):
    """The engine has failed (or was shut down) and takes no more requests."""


class RequestStream:
    """Output deltas of one request, read with ``async for`` (from any event
    loop) or a plain ``for`` loop; ends after the delta with ``finished``."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._event: Optional[asyncio.Event] = None
        self._done = False

    def put(self, item) -> None:
        self._queue.put(item)
        loop, event = self._loop, self._event
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

    def _take(self, item):
        if item is _END or self._done:
            raise StopIteration
        if item.finished:
            self._done = True
            self._queue.put(_END)
        return item

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        return self._take(self._queue.get())

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._loop is None:
            self._event = asyncio.Event()
            self._loop = asyncio.get_running_loop()
        while True:
            self._event.clear()
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                await self._event.wait()
                continue
            try:
                return self._take(item)
            except StopIteration:
                raise StopAsyncIteration from None


class AsyncLLMEngine:
    """``on_failure(exc)`` is called (from the engine thread) once, if the
    engine itself fails: the forward pass, a device error, a dead
    tensor-parallel worker. A failure while handling one request ends that
    request alone and the loop goes on."""

    def __init__(self, config: EngineConfig, engine: Optional[LLMEngine] = None,
                 on_failure: Optional[Callable[[BaseException], None]] = None):
        """Without ``engine``, builds an ``LLMEngine(config)`` in the engine
        thread (see the module docstring) and returns once it is loaded and
        serves eager steps (a compiled step, when asked for, is built in the
        background and takes over when warm); an error while building is raised here."""
        self.config = config
        self.on_failure = on_failure
        self._lock = threading.Lock()
        self._new: List[Tuple[SequenceGroup, RequestStream]] = []
        self._aborts: List[str] = []
        self._finishes: List[SeqFinish] = []   # from the output thread, for the core
        self._reports: "queue.SimpleQueue" = queue.SimpleQueue()   # the core's reports, for the output thread
        self._streams: Dict[str, RequestStream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self.error: Optional[BaseException] = None
        self.engine: Optional[LLMEngine] = engine
        built = threading.Event()
        failure: List[BaseException] = []

        def build_and_run() -> None:
            try:
                if self.engine is None:   # ready at once; the compiled step follows
                    self.engine = LLMEngine(config, compile_in_background=True)
                self.tokenizer = self.engine.tokenizer
                self._stats = self.engine.get_stats()
            except BaseException as exc:   # raised again in the constructing thread
                failure.append(exc)
                return
            finally:
                built.set()
            self._run()

        self._thread = threading.Thread(target=build_and_run, name="pagedbackend-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        self._output_thread = threading.Thread(target=self._run_outputs, name="pagedbackend-outputs", daemon=True)
        self._output_thread.start()

    # ------------------------------------------------------------ API
    def add_request(self, request_id: str, prompt: Prompt, params: Optional[RequestParams] = None,
                    cumulative_logprob: bool = False, priority: Optional[int] = None,
                    lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Queue a request; its stream yields output deltas. ``cumulative_logprob``:
        compute it even when the parameters do not need it (``LLMEngine.make_group``);
        ``priority``: vLLM's argument (replaces ``params.priority``);
        ``lora_request``: its adapter (read from its folder here when new)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine has failed: {self.error!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shut down")
        group = self.engine.make_group(request_id, prompt, params,  # validates, may raise
                                       cumulative_logprob=cumulative_logprob, priority=priority,
                                       lora_request=lora_request)
        stream = RequestStream(request_id)
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._new.append((group, stream))
        self._wakeup.set()
        return stream

    # Adapters, vLLM's names; loading reads the folder in the calling thread.
    def add_lora(self, lora_request: LoRARequest, replace: bool = False) -> bool:
        return self.engine.add_lora(lora_request, replace)

    def remove_lora(self, lora_id) -> bool:
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> List[LoRARequest]:
        return self.engine.list_loras()

    def wait_for_compile(self, timeout: Optional[float] = None) -> bool:
        """Wait for the background compile of the model step (if any) to end;
        True once the compiled step serves."""
        return self.engine.runner.wait_for_compile(timeout)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wakeup.set()

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def runner(self) -> str:
        """What the model serves: "generate" or "pooling" (``EngineConfig.runner``, resolved)."""
        return self.engine.config.runner

    @property
    def max_prompt_chars(self) -> int:
        return self.engine.max_prompt_chars

    def describe(self) -> Dict[str, object]:
        """What serves (``LLMEngine.describe``)."""
        return self.engine.describe()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)
        self._reports.put(_END)
        self._output_thread.join(timeout)
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.put(self._final(stream.request_id, "abort", "the engine was shut down"))
        self.engine.runner.shutdown()
        self.engine.kv_events.shutdown()

    # ------------------------------------------------------------ loop
    def _run(self) -> None:
        engine = self.engine
        busy, refreshed = False, time.monotonic()
        while not self._stopping:
            try:
                self._take_requests()
                if not engine.has_unfinished_requests():
                    went_idle, busy = busy, False
                    if went_idle:  # nothing may be left behind
                        engine.check_idle()
                    if went_idle or time.monotonic() - refreshed > IDLE_STATS_S:
                        # idle gauges move too (the compiled step taking over)
                        self._stats, refreshed = engine.get_stats(), time.monotonic()
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
                    continue
                busy = True
                reports = engine.core_step()
                if reports:
                    self._reports.put(reports)
                self._stats = engine.get_stats()
            except Exception as exc:  # the engine itself failed
                self._die(exc)
                return

    def _die(self, exc: BaseException) -> None:
        logger.error("the engine failed; every open request is ended: %r", exc, exc_info=exc)
        self.error = exc
        self._fail_all(exc)
        if self.on_failure is not None:
            try:
                self.on_failure(exc)
            except Exception:
                logger.exception("on_failure callback raised")

    def _run_outputs(self) -> None:
        """The output thread: the core's reports become the streams' outputs;
        what stop strings end goes back to the engine thread."""
        outputs = self.engine.outputs
        while True:
            reports = self._reports.get()
            if reports is _END:
                return
            try:
                delivered, finishes = outputs.process(reports)
            except Exception as exc:   # a fault of the output processor itself
                self._stopping = True
                self._die(exc)
                return
            self._deliver(delivered)
            if finishes:
                with self._lock:
                    self._finishes += finishes
                self._wakeup.set()

    def _take_requests(self) -> None:
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            finishes, self._finishes = self._finishes, []
        if finishes:
            reports = self.engine.finish(finishes)
            if reports:
                self._reports.put(reports)
        finals, reports = [], []
        for group, _ in new:
            try:
                self.engine.add_group(group)
            except Exception as exc:  # this request alone
                logger.error("request %s could not be queued: %r", group.request_id, exc, exc_info=exc)
                finals.append(self._final(group.request_id, "abort", f"could not be queued: {exc!r}"))
        for request_id in aborts:
            try:
                report = self.engine.abort_core(request_id)
            except Exception as exc:  # this request alone
                logger.error("request %s could not be aborted: %r", request_id, exc, exc_info=exc)
                finals.append(self._final(request_id, "abort", f"could not be aborted: {exc!r}"))
                continue
            if report is not None:   # after its earlier outputs, through the output thread
                reports.append(report)
        if reports:
            self._reports.put(reports)
        if finals:
            self._deliver(finals)
        if new or aborts or finishes:
            self._stats = self.engine.get_stats()

    def _deliver(self, outputs: List[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
            for o in outputs:
                if o.finished:
                    self._streams.pop(o.request_id, None)
        for stream, out in targets:
            if stream is not None:
                stream.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.put(self._final(stream.request_id, "abort", f"the engine failed: {exc!r}"))

    @staticmethod
    def _final(request_id: str, reason: str, error: str) -> RequestOutput:
        return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], finish_reason=reason)],
                             True, None, error=error)
