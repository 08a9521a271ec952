"""Draft KV rows of finished requests, written to files for tests (test bed only).

With ``SGLANG_DYNSPEC_TESTBED_DRAFT_KV_DIR=<dir>`` (and the test bed armed), every
scheduler process of an EAGLE-family server writes, for each request that finishes,
``<dir>/<rid>.pt`` holding its token ids and the draft model's K and V rows at its
committed positions, read from the draft KV pool just before SGLang releases the
request's KV slots. Comparing these files between an EAGLE3 server and an
EAGLE3_DYNAMIC server shows whether the draft KV after a catch-up holds what an
always-speculating server writes.

Two SGLang hooks (``HookRegistry``): after ``EAGLEWorkerV2.__init__`` (remembers the
speculative worker, ours included, which subclasses it) and before
``mem_cache.common.release_kv_cache`` (the one place a request's KV row is freed,
on finish, abort or retraction; only finished requests are written).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DUMP_DIR_ENV = "SGLANG_DYNSPEC_TESTBED_DRAFT_KV_DIR"
WORKER_INIT = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.__init__"
RELEASE_KV = "sglang.srt.mem_cache.common.release_kv_cache"

_spec_worker = None


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(WORKER_INIT, _remember_worker, HookType.AFTER)
    HookRegistry.register(RELEASE_KV, _dump_before_release, HookType.BEFORE)


def _remember_worker(result, worker, *args, **kwargs):
    global _spec_worker
    _spec_worker = worker
    return None


def committed_positions(req) -> int:
    """Positions whose draft KV is final: every token but the last (still pending)."""
    return len(req.origin_input_ids) + len(req.output_ids) - 1


def _dump_before_release(req, tree_cache, *args, **kwargs):
    if _spec_worker is None or not req.finished():
        return None
    from sglang_dynspec.compat import request_pool_index

    n = committed_positions(req)
    pool = _spec_worker.draft_worker.draft_runner.token_to_kv_pool
    if pool.k_buffer[0].is_cuda:
        # Every stream: a buffer-full flush may still be writing on its own stream
        # (SGLANG_DYNSPEC_FLUSH_STREAM); SGLang's next draft forward would wait for it.
        torch.cuda.synchronize()
    slots = _spec_worker.req_to_token_pool.req_to_token[request_pool_index(req), :n].long()
    record = {
        "rid": req.rid,
        "token_ids": list(req.origin_input_ids) + list(req.output_ids),
        "k": torch.stack([buf[slots] for buf in pool.k_buffer]).cpu(),  # [layers, n, heads, dim]
        "v": torch.stack([buf[slots] for buf in pool.v_buffer]).cpu(),
    }
    out = Path(os.environ[DUMP_DIR_ENV]) / f"{req.rid}.pt"
    torch.save(record, out)
    return None


def load_dumps(directory) -> dict[str, dict]:
    """``{rid: record}`` for every dump file in ``directory``."""
    return {path.stem: torch.load(path, weights_only=False) for path in sorted(Path(directory).glob("*.pt"))}
