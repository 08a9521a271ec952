"""Run a test-bed SGLang server from Python, and talk to it over HTTP.

    from dynspec_testbed.server import CpuServer, OVERLAP_CI_ENV, dynamic_server_args, generate, serve
    from dynspec_testbed.workload import run_waves

    with CpuServer(["--model-path", models["target"]], log_path=tmp / "server.log") as server:
        out = generate(server.url, [0, 483, 14], max_new_tokens=16)

    outputs = serve(dynamic_server_args(models), lambda url: run_waves(url, waves),
                    log_path=tmp / "dynamic.log", env=OVERLAP_CI_ENV)

The end-to-end tests' vocabulary is here: the scheduler environments (``CI_ENV``,
``OVERLAP_CI_ENV``, ``TWO_RANK_CI_ENV``, ``retracting``), the server arguments on the
test bed's model pairs (``baseline_server_args``, ``speculative_server_args``,
``dynamic_server_args``), ``serve``, the non-speculative references a test session
shares (``ReferenceServers``) and the check that no KV is left once idle
(``assert_no_kv_left``).

``CpuServer`` starts ``python -m dynspec_testbed.serve`` in its own process
group on a free 127.0.0.1 port, with a temporary directory of its own, and on exit
stops the whole group and removes that directory, so no scheduler process and none of
the files SGLang leaves in the temporary directory outlive the block (its ZeroMQ
socket names are ``NamedTemporaryFile(delete=False)`` files, six per server, and the
test suite starts about two hundred servers). It also removes the shared-memory files
created while it ran that no live process maps (``/dev/shm``: multiprocessing
semaphores, SGLang's load snapshots and message queues; see
``remove_orphaned_shared_memory``). An idle SGLang scheduler keeps a CPU core
busy: on a small machine run one server at a time.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
from torch._inductor.runtime import cache_dir_utils as inductor_cache_dir

from dynspec_testbed.plugin import OVERLAP_ENV
from dynspec_testbed.serve import MODULE, server_environment
from sglang_dynspec.config import COST_CACHE_ENV

HOST = "127.0.0.1"
LOG_TAIL_LINES = 60

# ------------------------------------------------------------------ scheduler environments
# SGLang's CI switch makes it assert a missing overlap publish (otherwise silent, and
# wrong tokens follow). Speculative servers on the CPU run the synchronous scheduler
# unless the test bed's overlap switch is on (dynspec_testbed.plugin).
CI_ENV = {"SGLANG_IS_IN_CI": "1"}
OVERLAP_CI_ENV = {**CI_ENV, OVERLAP_ENV: "1"}
# --tp-size 2 on the CPU: one core per rank.
TWO_RANK_CI_ENV = {**CI_ENV, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def retracting(every: int) -> dict[str, str]:
    """SGLang's test switch that retracts running requests every ``every``-th forward."""
    return {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(every)}


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log tail."""


class PortTakenError(ServerStartError):
    """The chosen port was taken by another process before the server bound it."""


# uvicorn's message when the HTTP port is taken; the process stays up without serving.
BIND_FAILURE = "error while attempting to bind on address"
PORT_ATTEMPTS = 3
# Between /health_generate polls while a server starts: a refused connection costs
# microseconds, and each poll saved is time every server test waits.
HEALTH_POLL_S = 0.25


class CpuServer:
    """Context manager running one test-bed SGLang server.

    Args:
        server_args: SGLang server arguments (``--model-path`` etc.); the CPU
            defaults of ``serve.py`` apply. ``--host`` / ``--port`` are chosen here.
        log_path: file that receives the server's stdout and stderr.
        env: extra environment variables (e.g. ``SGLANG_DYNSPEC_TESTBED_OVERLAP``). The
            plugin's step-cost cache is off unless this or the caller's environment
            names one (``SGLANG_DYNSPEC_COST_CACHE``).
        port: the 127.0.0.1 port to serve on (default: a free one, chosen again if
            another process takes it first); for callers whose clients expect a fixed
            URL, such as SGLang's test kits.
        startup_timeout: seconds to wait for ``/health_generate``.
        stop_timeout: seconds to wait after SIGTERM before SIGKILL.
    """

    def __init__(
        self,
        server_args: Sequence[Any],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 300.0,
        stop_timeout: float = 30.0,
        port: int | None = None,
    ):
        args = [str(a) for a in server_args]
        owned = {a.split("=", 1)[0] for a in args} & {"--host", "--port"}
        if owned:
            raise ValueError(f"CpuServer chooses {sorted(owned)} itself; remove them")
        self._fixed_port = port is not None
        self.port = port if port is not None else _free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = Path(log_path)
        self.command = [sys.executable, "-m", MODULE, *args, "--host", HOST, "--port", str(self.port)]
        # Each server times its own step costs unless the caller names a cache: a table
        # cached by an earlier server (another test, another run, timed under other
        # load) would carry that server's timing into this one.
        self._env = server_environment({COST_CACHE_ENV: "off", **os.environ, **(env or {})})
        # The server's TMPDIR is its own (see the module docstring); torch's compile cache
        # stays where it would be without that (torch puts it under the temporary
        # directory), so that servers keep sharing what earlier ones compiled.
        self._env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir.default_cache_dir())
        self.temp_dir: Path | None = None
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._process: subprocess.Popen | None = None
        self._started_at = time.time()
        self.startup_seconds: float | None = None

    def __enter__(self) -> "CpuServer":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server and block until it answers ``/health_generate``.

        The port is free when chosen, but another process (another server's internal
        ports) may take it before this one binds it: then the server is started again
        on a new port, up to ``PORT_ATTEMPTS`` times."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._start_once()
                return
            except PortTakenError:
                if attempt == PORT_ATTEMPTS or self._fixed_port:
                    raise
                self.port = _free_port()
                self.url = f"http://{HOST}:{self.port}"
                self.command[-1] = str(self.port)

    def _start_once(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="dynspec-server-"))
        # Shared-memory files are matched to the server by time (file times are
        # whole-second on some file systems, hence the margin).
        self._started_at = time.time() - 1.0
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.command,
                env={**self._env, "TMPDIR": str(self.temp_dir)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group, stopped as a whole
            )
        try:
            self._wait_until_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def _wait_until_healthy(self, started: float) -> None:
        deadline = started + self._startup_timeout
        while True:
            code = self._process.poll()
            if code is not None:
                raise ServerStartError(self._failure(f"server exited with code {code}"))
            try:
                if httpx.get(f"{self.url}/health_generate", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if BIND_FAILURE in self.log_tail():
                raise PortTakenError(self._failure(f"port {self.port} was taken before the server bound it"))
            if time.monotonic() > deadline:
                raise ServerStartError(
                    self._failure(f"server not healthy after {self._startup_timeout:.0f} s")
                )
            time.sleep(HEALTH_POLL_S)

    def _failure(self, what: str) -> str:
        return (
            f"{what}: {' '.join(self.command)}\n"
            f"--- last {LOG_TAIL_LINES} lines of {self.log_path} ---\n{self.log_tail()}"
        )

    @property
    def pid(self) -> int | None:
        """The server's process id (its process group's id), None when stopped."""
        return None if self._process is None else self._process.pid

    def poll(self) -> int | None:
        """The server's exit code, None while it runs (``subprocess.Popen.poll``)."""
        return None if self._process is None else self._process.poll()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``stop_timeout``,
        wait until no process of the group remains, and remove the server's
        temporary directory. Idempotent."""
        if self._process is None:
            self._remove_temp_dir()
            return
        group = self._process.pid  # session leader: its pid is the group id
        _signal_group(group, signal.SIGTERM)
        try:
            self._process.wait(timeout=self._stop_timeout)
        except subprocess.TimeoutExpired:
            pass
        if not _wait_group_gone(group, timeout=self._stop_timeout):
            _signal_group(group, signal.SIGKILL)
            _wait_group_gone(group, timeout=self._stop_timeout)
        self._process.wait()
        self._process = None
        remove_orphaned_shared_memory(since=self._started_at)
        self._remove_temp_dir()

    def _remove_temp_dir(self) -> None:
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


SHARED_MEMORY = Path("/dev/shm")


def _shared_memory_in_use() -> set[Path]:
    """The ``/dev/shm`` files some live process has mapped, read from ``/proc``."""
    paths = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for line in lines:
            fields = line.split(maxsplit=5)
            # A mapping of a file already unlinked reads "PATH (deleted)".
            if len(fields) == 6 and not fields[5].endswith(" (deleted)"):
                path = Path(fields[5])
                if path.parent == SHARED_MEMORY:
                    paths.add(path)
    return paths


def remove_orphaned_shared_memory(since: float) -> list[Path]:
    """Unlink the ``/dev/shm`` files created or written since ``since`` (a ``time.time()``)
    that no live process has mapped, and return them.

    SGLang stops its children with SIGKILL, the multiprocessing resource tracker among
    them, so nothing unlinks the semaphores (``sem.mp-*``) and shared memory (load
    snapshots, message queues) its processes had: a day of test runs left about 600.
    A file nobody maps is no one's: every user of a named semaphore or shared-memory
    block keeps it mapped while it holds it."""
    if not SHARED_MEMORY.is_dir():
        return []
    recent = []
    for path in SHARED_MEMORY.iterdir():
        try:
            if path.stat().st_mtime >= since:
                recent.append(path)
        except OSError:
            continue
    # Listed before the scan: a file created after the listing is not a candidate, and
    # one created before it is mapped by its creator by the time of the scan.
    in_use = _shared_memory_in_use()
    orphans = [path for path in recent if path not in in_use]
    for path in orphans:
        path.unlink(missing_ok=True)
    return orphans


def _wait_group_gone(group: int, timeout: float) -> bool:
    """Wait until no process is left in ``group``; return whether that happened."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


# ------------------------------------------------------------------ server arguments
# The test bed's model pairs (dynspec_testbed.models): target and EAGLE-3 draft.
PAIRS = {
    "random": ("target", "draft"),
    "agree": ("target-agree", "draft-agree"),
    "count": ("target-count", "draft-count"),
    "wide": ("target-wide", "draft-wide"),
}


def baseline_server_args(
    models: Mapping[str, Any], pair: str = "random", *, extra: Sequence[Any] = ()
) -> list[Any]:
    """Arguments of a non-speculative server on the target of one of the model pairs."""
    return ["--model-path", models[PAIRS[pair][0]], *extra]


def speculative_server_args(
    algorithm: str,
    models: Mapping[str, Any],
    pair: str = "random",
    *,
    steps: int = 3,
    topk: int = 1,
    draft_tokens: int = 4,
    extra: Sequence[Any] = (),
) -> list[Any]:
    """Arguments of a speculative server (``EAGLE3``, ``EAGLE3_DYNAMIC``) on one of the
    model pairs (``random``, ``agree``, ``count`` or ``wide``)."""
    target, draft = PAIRS[pair]
    return [
        "--model-path", models[target],
        "--speculative-algorithm", algorithm,
        "--speculative-draft-model-path", models[draft],
        "--speculative-num-steps", steps,
        "--speculative-eagle-topk", topk,
        "--speculative-num-draft-tokens", draft_tokens,
        *extra,
    ]  # fmt: skip


def dynamic_server_args(
    models: Mapping[str, Any],
    pair: str = "random",
    *,
    policy: str | None = "threshold",
    disable_above: int | None = 3,
    dwell: int = 0,
    extra: Sequence[Any] = (),
    **speculative: int,
) -> list[Any]:
    """Arguments of an EAGLE3_DYNAMIC server with ``policy`` (None: the flag is not
    given, so the plugin's default, goodput, decides). The switching tests use the
    threshold policy, whose switches the load alone determines: plain above
    ``disable_above`` running requests (None: the flag is not given; with goodput it is
    a hard bound). ``speculative``: ``steps``, ``topk``, ``draft_tokens`` of
    ``speculative_server_args``."""
    chosen = () if policy is None else ("--speculative-dynamic-policy", policy)
    threshold = () if disable_above is None else ("--speculative-disable-batch-threshold", disable_above)
    flags = [*chosen, *threshold, "--speculative-min-dwell-steps", dwell, *extra]
    return speculative_server_args("EAGLE3_DYNAMIC", models, pair, extra=flags, **speculative)


# ------------------------------------------------------------------ serving
T = TypeVar("T")


def serve(
    server_args: Sequence[Any],
    workload: Callable[[str], T],
    *,
    log_path: Path,
    env: Mapping[str, str],
) -> T:
    """Start a test-bed server, run ``workload(url)`` on it, stop it; return what the
    workload returned."""
    with CpuServer(server_args, log_path=log_path, env=env) as server:
        return workload(server.url)


class ReferenceServers:
    """Non-speculative servers shared by the tests of a session, one per target model.

    Most end-to-end tests compare a speculative server's greedy outputs with a
    non-speculative server's on the same target. Starting that reference costs about a
    minute on the CPU bed (most of it importing SGLang in three processes) and serving
    it a few seconds, so one server per target answers them all: started on first use,
    with ``--sleep-on-idle`` (an idle SGLang scheduler otherwise keeps a core busy,
    which would slow the server under test), and stopped by :meth:`close`. Before each
    use it is idle and its prefix cache is flushed, so a test's requests meet the empty
    cache a fresh server has.
    """

    def __init__(self, models: Mapping[str, Any], log_dir: Path, env: Mapping[str, str] = CI_ENV):
        self._models, self._log_dir, self._env = models, Path(log_dir), dict(env)
        self._servers: dict[str, CpuServer] = {}

    def url(self, pair: str = "random") -> str:
        """The URL of the reference for ``pair``'s target (``random``, ``agree``, ``count``),
        idle and with an empty prefix cache."""
        server = self._servers.get(pair)
        if server is None:
            args = baseline_server_args(self._models, pair, extra=["--sleep-on-idle"])
            server = CpuServer(args, log_path=self._log_dir / f"reference-{pair}.log", env=self._env)
            server.start()
            self._servers[pair] = server
        wait_until_idle(server.url)
        flush_cache(server.url)
        return server.url

    def serve(self, pair: str, workload: Callable[[str], T]) -> T:
        """``workload(url)`` on the reference for ``pair``; what it returned."""
        return workload(self.url(pair))

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


# ------------------------------------------------------------------ requests


def _generate_body(
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    sampling_params: Mapping[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "input_ids": list(input_ids),
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            **(sampling_params or {}),
        },
        **extra,
    }


def _post_generate(url: str, body: Mapping[str, Any], timeout: float) -> Any:
    response = httpx.post(f"{url}/generate", json=body, timeout=timeout)
    if response.is_error:
        raise httpx.HTTPStatusError(
            f"/generate returned {response.status_code}: {response.text[:2000]}",
            request=response.request,
            response=response,
        )
    return response.json()


def generate(
    url: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    sampling_params: Mapping[str, Any] | None = None,
    timeout: float = 300.0,
    **extra: Any,
) -> dict[str, Any]:
    """POST ``/generate`` and return the response JSON.

    Decoding is greedy (``temperature 0``) unless ``sampling_params`` says
    otherwise; ``extra`` goes into the request body as is (``return_logprob``,
    ``rid``, ...). Raises ``httpx.HTTPStatusError`` with the server's message.
    """
    body = _generate_body(input_ids, max_new_tokens, sampling_params=sampling_params, **extra)
    return _post_generate(url, body, timeout)


def generate_batch(
    url: str, requests: Sequence[Mapping[str, Any]], timeout: float = 300.0
) -> list[dict[str, Any]]:
    """POST the requests as one batched ``/generate``; responses in input order.

    SGLang's tokenizer manager passes a batch's requests to the scheduler in one loop,
    so they reach the same scheduling step. Concurrent posts (``generate_concurrently``)
    can reach it one at a time on a loaded machine: a full test run once saw a wave of
    six arrive so spread out that no step held more than three. Each request is a
    mapping of ``generate`` keyword arguments without extras beyond
    ``sampling_params`` (a batch carries one value per request only for those).
    """
    bodies = [_generate_body(**request) for request in requests]
    for body in bodies:
        if set(body) != {"input_ids", "sampling_params"}:
            raise ValueError(f"generate_batch takes input_ids and sampling_params only, got {sorted(body)}")
    batch = {key: [body[key] for body in bodies] for key in ("input_ids", "sampling_params")}
    return _post_generate(url, batch, timeout)


def generate_concurrently(
    url: str, requests: Sequence[Mapping[str, Any]], concurrency: int
) -> list[dict[str, Any]]:
    """Send ``requests`` with at most ``concurrency`` in flight; results in input order.

    Each request is a mapping of ``generate`` keyword arguments, e.g.
    ``{"input_ids": [0, 5, 6], "max_new_tokens": 16}``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(generate, url, **request) for request in requests]
        return [future.result() for future in futures]


def flush_cache(url: str, timeout: float = 30.0) -> None:
    """Empty the server's prefix (radix) cache; it must be idle."""
    response = httpx.post(f"{url}/flush_cache", timeout=timeout)
    if response.is_error:
        raise RuntimeError(f"/flush_cache returned {response.status_code}: {response.text[:500]}")


def update_weights_from_disk(url: str, checkpoint: Path, recapture_cuda_graph: bool | None = None) -> dict:
    """Load ``checkpoint`` into the server's target through SGLang's
    ``/update_weights_from_disk``; ``recapture_cuda_graph`` is sent only when given (the
    server's default otherwise). Returns SGLang's answer; raises if the update failed."""
    body: dict[str, Any] = {"model_path": str(checkpoint)}
    if recapture_cuda_graph is not None:
        body["recapture_cuda_graph"] = recapture_cuda_graph
    response = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=600)
    answer = response.json()
    if response.status_code != 200 or not answer.get("success"):
        raise RuntimeError(f"/update_weights_from_disk failed ({response.status_code}): {answer}")
    return answer


def update_weights_from_tensor(url: str, checkpoint: Path, device: str = "cpu", tp_size: int = 1) -> dict:
    """Send the safetensors of ``checkpoint`` to the server through SGLang's
    ``/update_weights_from_tensor``, serialized as SGLang's ``Engine`` does (one payload
    per tensor-parallel rank), inside a weight-update session where the server has one
    (SGLang 0.5.23; 0.5.17 answers 404 and loads them directly). Returns SGLang's answer;
    raises if the update failed.

    ``device="cuda"`` sends CUDA IPC handles (the GPU harness); ``"cpu"`` sends
    shared-memory file names, which the server process can open (the default, a file
    descriptor handed over by this process, it cannot)."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.utils.common import MultiprocessingSerializer

    named_tensors = [
        (name, tensor.to(device))
        for file in sorted(Path(checkpoint).glob("*.safetensors"))
        for name, tensor in load_file(file).items()
    ]
    if not named_tensors:
        raise ValueError(f"no safetensors in {checkpoint}")
    if device == "cuda":
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # the device by UUID, as the server's side expects
        payload = MultiprocessingSerializer.serialize(named_tensors, output_str=True)
    else:
        strategy = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:  # read while pickling; the rest of this process keeps its own strategy
            payload = MultiprocessingSerializer.serialize(named_tensors, output_str=True)
        finally:
            torch.multiprocessing.set_sharing_strategy(strategy)
    session = httpx.post(f"{url}/begin_weight_update", json={}, timeout=600)
    in_session = session.status_code != 404
    if in_session:
        session.raise_for_status()
    try:
        # named_tensors stays alive until the server has answered: it opens them while it loads.
        response = httpx.post(
            f"{url}/update_weights_from_tensor",
            json={"serialized_named_tensors": [payload] * tp_size},
            timeout=600,
        )
    finally:  # a session left open would refuse the next one
        if in_session:
            httpx.post(f"{url}/end_weight_update", json={}, timeout=600).raise_for_status()
    answer = {"tensors": len(named_tensors), **response.json()}
    if response.status_code != 200 or not answer.get("success"):
        raise RuntimeError(f"/update_weights_from_tensor failed: {answer}")
    return answer


def get_loads(url: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Per-DP-rank load snapshots from ``/v1/loads`` (``num_running_reqs``,
    ``num_waiting_reqs``, ``num_used_tokens``, ``max_total_num_tokens``, ...)."""
    response = httpx.get(f"{url}/v1/loads", timeout=timeout)
    response.raise_for_status()
    return response.json()["loads"]


def wait_until_idle(url: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Poll ``/v1/loads`` until no rank has running or waiting requests, and
    return that snapshot. A KV leak then shows as ``num_used_tokens > 0``.

    The snapshot is published by the scheduler loop, so right after the last
    response it can still show the finished requests; hence the polling.
    """
    deadline = time.monotonic() + timeout
    while True:
        loads = get_loads(url)
        if all(load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 for load in loads):
            return loads
        if time.monotonic() > deadline:
            raise TimeoutError(f"server still busy after {timeout:.0f} s: {loads}")
        time.sleep(0.2)


def kv_left_once_idle(url: str, timeout: float = 30.0) -> list[int]:
    """Wait until the server is idle; the KV tokens each rank still holds (a leak unless 0)."""
    return [load["num_used_tokens"] for load in wait_until_idle(url, timeout)]


def assert_no_kv_left(url: str, timeout: float = 30.0) -> None:
    """Once idle, no rank holds a KV token: every request's KV was freed."""
    left = kv_left_once_idle(url, timeout)
    if any(left):
        raise AssertionError(f"KV tokens still in use once idle, per rank (a leak): {left}")
