"""Device time and device values of queued work, read without making the host wait.

The scheduler's host thread runs ahead of the device (under the overlap scheduler by
a whole step); a ``synchronize`` or a blocking read on the hot path would drain that
pipeline. So device work is bracketed by CUDA events, and its time is read by
polling: :class:`DeferredReadings` calls each callback once its timer has completed.
Host values go the other way through :func:`to_device`, which does not wait either.
Work that the current stream need not wait for goes on a :class:`SideStream`.
Plain torch; no SGLang.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch


class DeviceTimer:
    """Wall time of work queued on the current device stream, read without a sync.

    On CUDA two events bracket the work and ``seconds()`` returns None until the
    second has completed; elsewhere the work ran synchronously and host time is it.
    """

    def __init__(self, start_event, start_time: float):
        self._start, self._end = start_event, None
        self._t0, self._t1 = start_time, None

    @classmethod
    def start(cls, device) -> DeviceTimer:
        if torch.device(device).type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return cls(event, 0.0)
        return cls(None, time.perf_counter())

    @classmethod
    def marker(cls, device) -> DeviceTimer:
        """Completes (``seconds()`` is not None) once the work queued so far has run."""
        timer = cls.start(device)
        timer.stop()
        return timer

    def stop(self) -> None:
        if self._start is not None:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float | None:
        if self._start is None:
            return None if self._t1 is None else self._t1 - self._t0
        if self._end is None or not self._end.query():
            return None
        return self._start.elapsed_time(self._end) / 1000.0


class DeferredReadings:
    """Callbacks to run once their device work has completed, in the order queued.

    ``timer`` is anything with ``seconds() -> float | None`` (a :class:`DeviceTimer`).
    """

    def __init__(self):
        self._pending: list[tuple[DeviceTimer, Callable[[float], None]]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, timer: DeviceTimer, on_done: Callable[[float], None]) -> None:
        self._pending.append((timer, on_done))

    def poll(self) -> None:
        """Run the callbacks of completed work (each exactly once); never waits."""
        if not self._pending:
            return
        still = []
        for timer, on_done in self._pending:
            seconds = timer.seconds()
            if seconds is None:
                still.append((timer, on_done))
            else:
                on_done(seconds)
        self._pending = still


def read_later(values: torch.Tensor, readings: DeferredReadings, on_done: Callable[[list], None]) -> None:
    """Call ``on_done(values.tolist())`` once the device has computed ``values``.

    ``tolist()`` on a CUDA tensor waits for everything queued on the stream, later
    steps included; here the values are copied to the host behind the work that
    produces them (:class:`HostCopy`) and read once a marker queued after the copy
    has completed, so the read never waits.
    """
    if values.device.type != "cuda":
        on_done(values.tolist())
        return
    copy = HostCopy(values)
    readings.add(DeviceTimer.marker(values.device), lambda _seconds: on_done(copy.read()))


class HostCopy:
    """Device values copied to the host behind the work queued so far, read on demand.

    On CUDA the copy goes into pinned memory with an event after it; ``read`` waits
    for that event, which costs nothing once the work queued before the copy has
    run (the catch-up reads a gap's start a step or more after copying it, and by
    then the overlap scheduler has waited for that step's result itself). Elsewhere
    the values are copied at once.
    """

    def __init__(self, values: torch.Tensor):
        self._values: list | None = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values.clone()
            self._event = None

    def ready(self) -> bool:
        """True once the copy has run (``read`` would not wait); never waits itself."""
        return self._values is not None or self._event is None or self._event.query()

    def read(self) -> list:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
        return self._values


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values (a list) on ``device``, without making the host wait for the device.

    ``torch.tensor(values).to(device)`` copies from pageable memory, which PyTorch
    follows with a stream synchronize: at every prefill or catch-up that would drain
    the overlap scheduler's pipeline. A pinned staging tensor and an asynchronous copy
    do not (PyTorch keeps the staging memory alive until the copy has run).
    """
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class SideStream:
    """Device work queued on a second stream, beside the current stream's, and the
    points where the current stream must wait for it.

    ``queue(*keep)`` runs its block's device work on the side stream, after the work
    the current stream had queued (whose results the block reads); ``keep``: objects
    whose tensors, made on the current stream, the block reads: they are held until the
    side stream has run, so the caching allocator does not hand their memory to the
    current stream's next work. ``join()`` makes the current stream wait, on the device,
    for everything queued so far (the host never waits); ``busy()`` says, without
    waiting, whether queued work has not run yet. Without a CUDA device the block runs
    in order and only the bookkeeping remains.
    """

    def __init__(self, device):
        cuda = torch.device(device).type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._done = None  # the event after the last queued block, until joined or run
        self._kept: list = []
        self.pending = False  # a block was queued and not joined yet

    @contextlib.contextmanager
    def queue(self, *keep) -> Iterator[None]:
        self.pending = True
        if self._stream is None:
            yield
            return
        # What earlier blocks kept goes once they have run, so a long plain phase with
        # no join (no prefill, no resume) holds at most the flushes still in flight.
        self.busy()
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            yield
            self._done = torch.cuda.Event()
            self._done.record(self._stream)
        self._kept.append(keep)

    def busy(self) -> bool:
        """True while queued work has not run; never waits (it drops what it kept once run)."""
        if self._done is not None and not self._done.query():
            return True
        self._kept.clear()
        return False

    def join(self) -> None:
        """The current stream waits, on the device, for the work queued so far."""
        if self._done is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._done)
            self._done = None
        self._kept.clear()  # the current stream's later work is ordered after it
        self.pending = False
