"""A fake SGLang server for testing the benchmark without a GPU.

It emulates the parts of SGLang the benchmark talks to:

* ``POST /generate`` with ``"stream": true``: SSE ``data: {...}`` events with
  cumulative ``meta_info.completion_tokens`` (and cumulative ``output_ids``,
  or deltas with ``incremental=True``), ``text`` unless
  ``skip_tokenizer_init=True``, ``spec_accept_length`` once a speculative
  step happened, then ``data: [DONE]``;
* ``GET /metrics``: ``sglang:num_running_reqs`` and, with
  ``plugin_metrics=True``, the EAGLE3_DYNAMIC gauge and counters (one series
  per emulated TP rank, with SGLang-like extra labels);
* ``GET /server_info`` (or only the deprecated ``/get_server_info``).

Requests are served by one batch "scheduler" loop, like the real thing: every
``step_s`` seconds each running request receives one chunk with
``spec_tokens`` new tokens in speculative mode or one token in plain mode;
a new request gets its first token (the "prefill") at the next step.  With
``switch_above=N`` the fake turns speculation off while more than N requests
are running, and every switch delays that step by ``switch_stall_s`` -- so
the numbers the benchmark should compute are known in advance.

Run standalone for a dry run of the CLI::

    python -m dynspec_testbed.fake_server --port 30000 --switch-above 16
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from sglang_dynspec.bench.scrape import RUNNING
from sglang_dynspec.metric_names import HELP, MODE_GAUGE, MODES, STEPS_COUNTER, SWITCHES_COUNTER

_PLUGIN_METRICS = (MODE_GAUGE, STEPS_COUNTER, SWITCHES_COUNTER)


def _mode_name(mode: int) -> str:
    """The ``mode`` / ``to`` label value of mode 1 (speculating) or 0 (plain)."""
    spec, plain = MODES
    return spec if mode else plain


def _is_plugin_line(line: str) -> bool:
    return any(name in line for name in _PLUGIN_METRICS)


@dataclass
class _Req:
    rid: int
    max_new_tokens: int
    queue: asyncio.Queue
    generated: int = 0
    spec_steps: int = 0
    output_ids: list[int] = field(default_factory=list)


class FakeSGLang:
    def __init__(
        self,
        step_s: float = 0.01,
        spec_tokens: int = 3,
        switch_above: int | None = None,
        switch_stall_s: float = 0.0,
        start_in_spec: bool = True,
        plugin_metrics: bool = True,
        metrics_endpoint: bool = True,
        tp_ranks: int = 1,
        version: str = "0.5.23",
        info_path: str | None = "/server_info",
        incremental: bool = False,
        skip_tokenizer_init: bool = False,
        error_every: int = 0,
        keep_prompts: bool = False,
    ):
        self.step_s = step_s
        self.spec_tokens = spec_tokens
        self.switch_above = switch_above
        self.switch_stall_s = switch_stall_s
        self.mode = 1 if start_in_spec else 0
        self.plugin_metrics = plugin_metrics
        self.metrics_endpoint = metrics_endpoint
        self.tp_ranks = tp_ranks
        self.version = version
        self.info_path = info_path
        self.incremental = incremental
        self.skip_tokenizer_init = skip_tokenizer_init
        self.error_every = error_every

        self.active: dict[int, _Req] = {}
        self.num_requests = 0
        # With keep_prompts, each request's prompt as received (token ids or text), in
        # arrival order, for tests; off by default so that a long-running fake holds no
        # per-request state after the request ends.
        self.keep_prompts = keep_prompts
        self.prompts: list[list[int] | str] = []
        self.num_switches = 0
        self._rids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None

        self.registry = CollectorRegistry()
        labels = ["model_name", "tp_rank"]
        self._g_mode = Gauge(MODE_GAUGE, HELP[MODE_GAUGE], labels, registry=self.registry)
        self._c_steps = Counter(STEPS_COUNTER, HELP[STEPS_COUNTER], [*labels, "mode"], registry=self.registry)
        self._c_switch = Counter(
            SWITCHES_COUNTER, HELP[SWITCHES_COUNTER], [*labels, "to"], registry=self.registry
        )
        self._g_running = Gauge(
            RUNNING, "Running requests (SGLang's own gauge).", labels, registry=self.registry
        )
        self._set_mode_gauge()

    # -- metrics -----------------------------------------------------------

    def _ranks(self):
        return [{"model_name": "fake", "tp_rank": str(r)} for r in range(self.tp_ranks)]

    def _set_mode_gauge(self) -> None:
        for lb in self._ranks():
            self._g_mode.labels(**lb).set(self.mode)

    def metrics_text(self) -> str:
        for lb in self._ranks():
            self._g_running.labels(**lb).set(len(self.active) if lb["tp_rank"] == "0" else 0)
        text = generate_latest(self.registry).decode()
        if not self.plugin_metrics:
            text = "\n".join(line for line in text.splitlines() if not _is_plugin_line(line)) + "\n"
        return text

    # -- scheduler -----------------------------------------------------------

    async def _scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while True:
            if not self.active:
                self._wake.clear()
                await self._wake.wait()
                next_t = loop.time() + self.step_s  # first token one step later
            delay = next_t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -self.step_s:
                next_t = loop.time()  # fell behind (slow machine): don't burst
            batch = list(self.active.values())
            if not batch:
                continue
            if self.switch_above is not None:
                want = 0 if len(batch) > self.switch_above else 1
                if want != self.mode:
                    self.mode = want
                    self.num_switches += 1
                    for lb in self._ranks():
                        self._c_switch.labels(**lb, to=_mode_name(want)).inc()
                    self._set_mode_gauge()
                    if self.switch_stall_s:
                        # What a switch that is not seamless looks like to
                        # clients: one step takes longer.
                        await asyncio.sleep(self.switch_stall_s)
                        next_t += self.switch_stall_s
            mode_label = _mode_name(self.mode)
            for lb in self._ranks():
                self._c_steps.labels(**lb, mode=mode_label).inc()
            for req in batch:
                if req.generated == 0:
                    n = 1  # prefill produces exactly one token
                else:
                    n = self.spec_tokens if self.mode else 1
                    if self.mode:
                        req.spec_steps += 1
                n = min(n, req.max_new_tokens - req.generated)
                new_ids = [(req.rid * 7 + req.generated + i) % 1000 for i in range(n)]
                req.output_ids.extend(new_ids)
                req.generated += n
                finished = req.generated >= req.max_new_tokens
                req.queue.put_nowait(self._chunk(req, new_ids, finished))
                if finished:
                    del self.active[req.rid]
            next_t += self.step_s

    def _chunk(self, req: _Req, new_ids: list[int], finished: bool) -> dict:
        meta = {
            "id": str(req.rid),
            "prompt_tokens": 0,
            "completion_tokens": req.generated,
            "finish_reason": {"type": "length", "length": req.max_new_tokens} if finished else None,
        }
        if req.spec_steps:
            # Same formula as SGLang: completion_tokens / spec_verify_ct.
            meta["spec_accept_length"] = req.generated / req.spec_steps
            meta["spec_verify_ct"] = req.spec_steps
        ids = new_ids if self.incremental else list(req.output_ids)
        out = {"output_ids": ids, "meta_info": meta}
        if not self.skip_tokenizer_init:
            out["text"] = " ".join(f"t{i}" for i in ids)
        return out

    # -- HTTP ------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "input_ids" not in body and "text" not in body:
            return web.json_response({"error": "need input_ids or text"}, status=400)
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        rid = next(self._rids)
        self.num_requests += 1
        if self.keep_prompts:
            self.prompts.append(body.get("input_ids", body.get("text")))
        queue: asyncio.Queue = asyncio.Queue()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.error_every and self.num_requests % self.error_every == 0:
            err = {"error": {"message": "fake failure", "code": 500}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        req = _Req(rid, max_new, queue)
        self.active[rid] = req
        self._wake.set()
        try:
            while True:
                chunk = await queue.get()
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if chunk["meta_info"]["finish_reason"] is not None:
                    break
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.active.pop(rid, None)  # client went away: stop generating
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.metrics_endpoint:
            raise web.HTTPNotFound()
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "version": self.version,
                "model_path": "fake/model",
                "speculative_algorithm": "EAGLE3_DYNAMIC",
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        if self.info_path:
            app.router.add_get(self.info_path, self._server_info)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start serving; returns the base URL (port 0 = pick a free one)."""
        self._wake = asyncio.Event()
        self._loop_task = asyncio.ensure_future(self._scheduler())
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        return f"http://{host}:{bound}"

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        if self._runner is not None:
            await self._runner.cleanup()


class FakeServerThread:
    """Run a :class:`FakeSGLang` on its own event loop in a daemon thread, so
    synchronous code (tests, the CLI's ``asyncio.run``) can talk to it::

        with FakeServerThread(FakeSGLang(step_s=0.01)) as url:
            main(["sweep", "--url", url, ...])
    """

    def __init__(self, fake: FakeSGLang):
        self.fake = fake
        self.url: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self.fake.start(), self._loop)
        self.url = fut.result(timeout=30)
        return self.url

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.fake.stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m dynspec_testbed.fake_server",
        description="Fake SGLang server (streaming /generate, /metrics, /server_info) "
        "for trying the benchmark without a GPU.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--step-ms", type=float, default=10.0, help="decode step time")
    p.add_argument("--spec-tokens", type=int, default=3, help="tokens per step while speculating")
    p.add_argument(
        "--switch-above", type=int, default=None, help="stop speculating while more than N requests run"
    )
    p.add_argument(
        "--stall-ms", type=float, default=0.0, help="extra delay of the step in which a switch happens"
    )
    a = p.parse_args(argv)
    fake = FakeSGLang(
        step_s=a.step_ms / 1000,
        spec_tokens=a.spec_tokens,
        switch_above=a.switch_above,
        switch_stall_s=a.stall_ms / 1000,
    )

    async def serve():
        url = await fake.start(a.host, a.port)
        print(f"fake SGLang server on {url}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
