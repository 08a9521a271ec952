"""Load generation against SGLang's native ``/generate`` endpoint (aiohttp).

What ``/generate`` with ``"stream": true`` sends (checked against the SGLang
0.5.17 and 0.5.23 sources: ``srt/entrypoints/http_server.py`` and
``srt/managers/tokenizer_manager.py``; both versions behave the same):

* a ``text/event-stream`` of ``data: <json>\\n\\n`` events, terminated by
  ``data: [DONE]\\n\\n``;
* each JSON object has ``meta_info`` with the *cumulative*
  ``completion_tokens`` (plus ``spec_accept_length`` etc. once a speculative
  verify step happened), ``output_ids`` and, unless the server runs with
  ``--skip-tokenizer-init``, ``text``;
* ``output_ids``/``text`` are cumulative by default but are deltas when the
  server runs with ``--incremental-streaming-output``;
* when the client is slower than the server the tokenizer manager drains its
  queue and sends only the latest state (or, in incremental mode, the
  concatenated deltas), so one event can carry several new tokens even
  without speculative decoding;
* an error after the stream started arrives as ``data: {"error": {...}}``;
  a request aborted by the scheduler finishes with
  ``meta_info.finish_reason = {"type": "abort", ...}``.

Counting tokens with the cumulative ``meta_info.completion_tokens`` is
therefore the one method that works for every server flag combination; the
client never looks at ``output_ids`` or ``text``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import aiohttp

from .stats import RequestTrace, add_chunk

try:
    # Every event of a cumulative stream repeats all output_ids so far, so
    # parsing cost grows with output length; at concurrency 128 the stdlib
    # parser can make this client, not the server, the bottleneck.  orjson
    # (an SGLang dependency, so usually present) is several times faster.
    from orjson import loads as _json_loads
except ImportError:  # pragma: no cover - depends on the environment
    _json_loads = json.loads


class ServerUnreachable(RuntimeError):
    """The server could not be contacted at all."""


class BenchmarkError(RuntimeError):
    """A run cannot produce meaningful results (e.g. every request failed)."""


# Frequent English words: with BPE tokenizers nearly every " word" is one
# token, so a prompt of N words is roughly N tokens.
_WORDS = tuple(
    dict.fromkeys(
        (
            "the of and to in is was for that on as with by he at from his it an were are "
            "which this be or has had not first one their its new after but who they two "
            "been her she all also time other more into during there when can over only "
            "three most some would than between about year then city may these later such "
            "used under many state while both where being team them through world since "
            "early game school well before second part known because him until number then "
            "four each people including found became three season same several up high "
            "work film group each last long major made north south east west old did "
            "during area family life music back out like won government so series name "
            "what my will if no way could day any make over take could year into good "
            "give most us very just man think also come its our because any these work "
            "water light river house small great large place end point home hand line "
            "right left little own still turn think play move live word read write open "
            "close answer story study question power country order learn change money "
            "night morning paper market history system program reason result level field"
        ).split()
    )
)


def normalize_base_url(url: str) -> str:
    """``http://host:30000/`` or ``.../generate`` -> ``http://host:30000``."""
    url = url.strip().rstrip("/")
    if url.endswith("/generate"):
        url = url[: -len("/generate")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url must look like http://HOST:PORT, got {url!r}")
    return url


class FirstTokens:
    """First token ids that no two prompts of one run share.

    Random prompts share a first token now and then (about four pairs among
    512 prompts drawn from 31,000 ids). SGLang's radix cache then serves that
    token from the cache on a server without speculative decoding only: EAGLE
    servers key the cache by token pairs (``RadixKey``'s bigram view), so they
    never match one token. On the baseline those few cached tokens shift the
    chunked prefill's chunks off the prompts (33 requests per 8,192-token
    chunk, one of them split). In the run where this was seen, at concurrency
    128 with ``--max-running-requests 128``, the baseline alone also ran 127
    requests with one queued for a whole request's length and ended each point
    with 2-3 requests decoding alone for about 240 steps
    (benchmarks/results/h100-20261207d-d03009e/README.md; the link between the
    two is inferred). Either way the servers should not see different work.

    The ``k``-th prompt of a run starts with ``lo + (offset + k) mod (hi - lo)``,
    the offset derived from the run's seed: no repeat within a run of fewer
    than ``hi - lo`` prompts, and the same ids on every server given the same
    seed and points. Separate runs on one server should use distinct seeds.
    Token-id prompts only: a text prompt's first token is the tokenizer's.
    """

    def __init__(self, seed: str, token_range: tuple[int, int]) -> None:
        lo, hi = token_range
        self._lo, self._span = lo, hi - lo
        digest = hashlib.sha256(f"{seed}/first-tokens".encode()).digest()
        self._next = int.from_bytes(digest[:8], "big") % self._span

    def take(self) -> int:
        token = self._lo + self._next % self._span
        self._next += 1
        return token


def make_prompt(
    rng: random.Random,
    prompt_len: int,
    text: bool,
    token_range: tuple[int, int],
    first_tokens: FirstTokens | None = None,
):
    """A random prompt: ``prompt_len`` token ids drawn uniformly from
    ``token_range`` (half-open), the first one from ``first_tokens`` when
    given, or ``prompt_len`` random common English words when ``text`` is
    true (token count then only approximate; ``first_tokens`` unused)."""
    if text:
        return " ".join(rng.choice(_WORDS) for _ in range(prompt_len))
    lo, hi = token_range
    prompt = [rng.randrange(lo, hi) for _ in range(prompt_len)]
    if first_tokens is not None and prompt:
        prompt[0] = first_tokens.take()
    return prompt


def make_payload(prompt, output_len: int) -> dict[str, object]:
    """Body of a greedy, fixed-length, streamed ``/generate`` request."""
    return {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {
            # 0.5.23 validates the body against a schema: temperature is a
            # float and unknown sampling keys are rejected -- send only these.
            "temperature": 0.0,
            "max_new_tokens": output_len,
            "ignore_eos": True,
        },
        "stream": True,
    }


def make_payloads(
    n: int,
    prompt_len: int,
    output_len: int,
    text: bool,
    token_range: tuple[int, int],
    seed: str,
    first_tokens: FirstTokens | None = None,
) -> list[dict[str, object]]:
    """``n`` request bodies from a reproducible seed.

    Two runs with the same seed send byte-identical prompts, so a baseline and
    a candidate server see the same work.  Callers derive a distinct seed per
    point and repeat, and pass the run's :class:`FirstTokens`, so that no
    prompt hits the radix (prefix) cache of another.
    """
    rng = random.Random(seed)  # str seeds hash with SHA-512: stable across runs
    return [
        make_payload(make_prompt(rng, prompt_len, text, token_range, first_tokens), output_len)
        for _ in range(n)
    ]


# How long an idle pooled connection may be reused. SGLang's HTTP server closes a
# connection after 5 s idle (SGLANG_TIMEOUT_KEEP_ALIVE); aiohttp keeps one for 15 s by
# default, so a request could take a connection the server was closing at that moment
# and fail with ServerDisconnectedError. That ended a sweep on 2026-12-06
# (benchmarks/results/h100-20261206-47ce381/README.md): after a 128-request point, a 5 s
# point left 127 connections idle just past 5 s when the next point took four of them.
IDLE_CONNECTION_S = 2.0


def create_session(read_timeout_s: float) -> aiohttp.ClientSession:
    """One session for the whole run.

    ``limit=0``: aiohttp's default connector allows only 100 concurrent
    connections, which would silently cap a concurrency-128 point.
    ``keepalive_timeout``: idle connections are dropped well before the server
    drops them (:data:`IDLE_CONNECTION_S`).
    ``sock_read`` (not ``total``) bounds how long a stream may stay silent, so
    long generations are fine but a wedged server is detected.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=read_timeout_s),
        # Larger than the 64 KiB default so a briefly busy client does not
        # push back on the server through TCP flow control (bench_serving
        # does the same).
        read_bufsize=4 * 1024**2,
    )


async def fetch_server_info(session: aiohttp.ClientSession, base_url: str) -> dict | None:
    """The JSON of ``/server_info`` (``/get_server_info`` on servers that only
    have the deprecated name), or ``None`` if neither exists.

    Raises :class:`ServerUnreachable` if nothing answers at ``base_url``.
    """
    for path in ("/server_info", "/get_server_info"):
        try:
            async with session.get(base_url + path, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status != 200:
                    continue
                try:
                    info = await resp.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    continue
                if isinstance(info, dict):
                    return info
        except aiohttp.ClientConnectionError as e:
            raise ServerUnreachable(f"cannot reach SGLang server at {base_url}: {e}") from None
        except asyncio.TimeoutError:
            raise ServerUnreachable(
                f"SGLang server at {base_url} did not answer {path} within 30 s"
            ) from None
    return None


def server_fields(info: dict | None) -> dict[str, object]:
    """Fields recorded with every result: server version and what it serves."""
    info = info or {}
    return {
        "sglang": info.get("version"),
        "model": info.get("model_path"),
        "speculative_algorithm": info.get("speculative_algorithm"),
    }


async def stream_generate(
    session: aiohttp.ClientSession,
    generate_url: str,
    payload: dict[str, object],
) -> RequestTrace:
    """Send one streamed ``/generate`` request and time every chunk.

    Never raises for request-level failures: they are returned in
    ``trace.error`` so one bad request does not end a benchmark.  A chunk's
    time is taken when its bytes are read, before parsing.
    """
    trace = RequestTrace(start=time.perf_counter())
    done = False

    def handle(line: bytes, now: float) -> None:
        nonlocal done
        line = line.strip()
        if not line.startswith(b"data:"):
            return  # blank separator, SSE comment or field we don't use
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            return
        obj = _json_loads(data)
        if not isinstance(obj, dict):
            raise _StreamError(f"unexpected stream event: {data[:100]!r}")
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise _StreamError(f"server error in stream: {msg}")
        meta = obj.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise _StreamError(f"request aborted by server: {finish.get('message')}")
        completion_tokens = meta.get("completion_tokens")
        if completion_tokens is None:
            raise _StreamError(
                "stream event without meta_info.completion_tokens (is this SGLang's native /generate?)"
            )
        if meta.get("spec_accept_length") is not None:
            trace.accept_length = float(meta["spec_accept_length"])
        add_chunk(trace, now, int(completion_tokens))

    try:
        async with session.post(generate_url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300].strip()
                trace.error = f"HTTP {resp.status}: {body}"
                return trace
            buf = b""
            # iter_any + own line splitting: StreamReader's line iterator has
            # a 64 KiB line limit that cumulative output_ids can exceed.
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    handle(line, now)
            if buf:
                handle(buf, time.perf_counter())
        if not done:
            trace.error = "stream ended without 'data: [DONE]'"
        else:
            trace.end = time.perf_counter()
    except _StreamError as e:
        trace.error = str(e)
    except ValueError as e:  # json's and orjson's JSONDecodeError subclass it
        trace.error = f"malformed stream event: {e}"
    except asyncio.TimeoutError:
        trace.error = "timed out waiting for the stream"
    except aiohttp.ClientError as e:
        trace.error = f"{type(e).__name__}: {e}"
    return trace


class _StreamError(Exception):
    pass


async def run_closed_loop(
    session: aiohttp.ClientSession,
    generate_url: str,
    payloads: Sequence[dict[str, object]],
    concurrency: int,
    on_done: Callable[[RequestTrace], None] | None = None,
) -> tuple[list[RequestTrace], float]:
    """Send ``payloads`` keeping exactly ``concurrency`` requests in flight
    (a new one starts as soon as one finishes) until all are done.

    Returns the traces (in payload order) and the wall time from the first
    request sent to the last one finished.
    """
    traces: list[RequestTrace | None] = [None] * len(payloads)
    it = iter(range(len(payloads)))

    async def worker() -> None:
        for i in it:  # shared iterator: each index is taken exactly once
            tr = await stream_generate(session, generate_url, payloads[i])
            traces[i] = tr
            if on_done is not None:
                on_done(tr)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(payloads)))))
    wall = time.perf_counter() - t0
    return [t for t in traces if t is not None], wall


def check_errors(traces: Sequence[RequestTrace], what: str, url: str) -> None:
    """Raise :class:`BenchmarkError` if every request of a measurement failed."""
    if traces and all(not t.ok for t in traces):
        first = next(t.error for t in traces if t.error)
        raise BenchmarkError(f"all {len(traces)} requests of {what} to {url} failed; first error: {first}")
