"""Deterministic request sets and load patterns for the CPU test bed, and output comparison.

Used by the end-to-end tests and the demo: the same requests go to a
non-speculative reference server and to the server under test, in the same load
pattern, and the greedy outputs must agree token for token.

A *wave* is a group of requests sent together; a list of waves with sizes such as
1, 2, 5, 10, 1 makes the decode batch cross a batch-size threshold up and back
down. A *staggered* run sends requests one after another with a short gap, so new
requests join a batch that is already decoding (and prefill mixes with decode).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from dynspec_testbed.server import generate, generate_batch, generate_concurrently


@dataclass(frozen=True)
class Request:
    rid: str
    input_ids: tuple
    max_new_tokens: int
    extra: Mapping[str, Any] = field(default_factory=dict)  # e.g. return_logprob, sampling_params

    def kwargs(self) -> dict[str, Any]:
        extra = dict(self.extra)
        sampling = {"ignore_eos": True, **extra.pop("sampling_params", {})}
        return {
            "input_ids": list(self.input_ids),
            "max_new_tokens": self.max_new_tokens,
            "sampling_params": sampling,
            **extra,
        }


def random_requests(
    count: int,
    *,
    seed: int,
    prefix: str = "r",
    vocab: Sequence[int] = (3, 500),
    prompt_len: Sequence[int] = (4, 24),
    new_tokens: Sequence[int] = (6, 40),
    extra: Mapping[str, Any] | None = None,
) -> list[Request]:
    """``count`` requests with random prompts (token ids in ``vocab``) and lengths."""
    rng = random.Random(seed)
    return [
        Request(
            rid=f"{prefix}{i}",
            input_ids=tuple(rng.randrange(*vocab) for _ in range(rng.randint(*prompt_len))),
            max_new_tokens=rng.randint(*new_tokens),
            extra=dict(extra or {}),
        )
        for i in range(count)
    ]


def split_into_waves(requests: Sequence[Request], sizes: Sequence[int]) -> list[list[Request]]:
    """Consecutive groups of the given sizes (their sum must equal ``len(requests)``)."""
    if sum(sizes) != len(requests):
        raise ValueError(f"wave sizes {list(sizes)} sum to {sum(sizes)}, not {len(requests)}")
    waves, start = [], 0
    for size in sizes:
        waves.append(list(requests[start : start + size]))
        start += size
    return waves


def waves_of(sizes: Sequence[int], *, seed: int, prefix: str = "w", **kwargs) -> list[list[Request]]:
    """Random requests grouped in waves of the given sizes."""
    return split_into_waves(random_requests(sum(sizes), seed=seed, prefix=prefix, **kwargs), sizes)


def run_waves(
    url: str, waves: Sequence[Sequence[Request]], on_wave=None, *, batched: bool = False
) -> dict[str, dict]:
    """Send each wave concurrently, one wave after another; responses by request id.

    ``on_wave(index, wave)`` is called after each wave completes (the demo uses it
    to read the server's mode counters between waves). ``batched``: each wave as one
    batched request (``generate_batch``), so that its requests reach the scheduler
    together, for tests that need a wave's requests to decode side by side.
    """
    results: dict[str, dict] = {}
    for index, wave in enumerate(waves):
        if batched:
            responses = generate_batch(url, [r.kwargs() for r in wave])
        else:
            responses = generate_concurrently(url, [r.kwargs() for r in wave], concurrency=len(wave))
        results.update({r.rid: resp for r, resp in zip(wave, responses)})
        if on_wave is not None:
            on_wave(index, wave)
    return results


def run_staggered(
    url: str, requests: Sequence[Request], gap_s: float, concurrency: int = 16
) -> dict[str, dict]:
    """Start requests ``gap_s`` apart, so they join a batch that is already decoding."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = []
        for r in requests:
            futures.append((r.rid, pool.submit(generate, url, **r.kwargs())))
            time.sleep(gap_s)
        return {rid: f.result() for rid, f in futures}


@dataclass
class Mismatch:
    rid: str
    what: str

    def __str__(self) -> str:
        return f"{self.rid}: {self.what}"


def _first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i}: reference {x}, got {y}"
    return f"lengths differ: reference {len(a)}, got {len(b)}"


def compare_outputs(
    reference: Mapping[str, dict], candidate: Mapping[str, dict], logprob_tolerance: float = 1e-3
) -> list[Mismatch]:
    """Token-for-token comparison of greedy outputs (and logprobs where returned)."""
    mismatches: list[Mismatch] = []
    if set(reference) != set(candidate):
        missing = sorted(set(reference) ^ set(candidate))
        return [Mismatch("*", f"request ids differ: {missing[:10]}")]
    for rid in sorted(reference):
        ref, got = reference[rid], candidate[rid]
        if ref["output_ids"] != got["output_ids"]:
            mismatches.append(Mismatch(rid, _first_difference(ref["output_ids"], got["output_ids"])))
            continue
        ref_lp = ref["meta_info"].get("output_token_logprobs")
        got_lp = got["meta_info"].get("output_token_logprobs")
        if ref_lp is not None or got_lp is not None:
            if ref_lp is None or got_lp is None or len(ref_lp) != len(got_lp):
                mismatches.append(Mismatch(rid, "output_token_logprobs missing or of another length"))
                continue
            worst = max((abs(a[0] - b[0]) for a, b in zip(ref_lp, got_lp)), default=0.0)
            if worst > logprob_tolerance:
                mismatches.append(Mismatch(rid, f"logprob differs by {worst:.2e}"))
            ref_top = ref["meta_info"].get("output_top_logprobs")
            got_top = got["meta_info"].get("output_top_logprobs")
            if ref_top is not None:
                ref_ids = [[t[1] for t in step] for step in ref_top]
                got_ids = [[t[1] for t in step] for step in (got_top or [])]
                if ref_ids != got_ids:
                    mismatches.append(Mismatch(rid, "top-logprob token ids differ"))
    return mismatches


def count_tokens(results: Mapping[str, dict]) -> int:
    return sum(len(r["output_ids"]) for r in results.values())


# ----------------------------------------------------------------- server state
def plugin_counters(url: str):
    """EAGLE3_DYNAMIC's mode, step and switch counters from ``/metrics``
    (needs ``--enable-metrics``), as a ``bench.scrape.MetricsSnapshot``."""
    from sglang_dynspec.bench.scrape import parse_metrics

    response = httpx.get(f"{url}/metrics", timeout=30)
    response.raise_for_status()
    return parse_metrics(response.text)
