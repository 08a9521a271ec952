"""SGLang's split-KV verify kernel against the prefill kernel the triton backend uses for
TARGET_VERIFY, on the GPU at the 8B target's attention shape (issue 20).

Per (batch size, prefix length): bf16 queries, keys and values at random, a pool of KV
rows in random order (as the allocator hands them out), the chain mask the backend
passes with topk 1, and both kernels as ``TritonAttnBackend.forward_extend`` calls them;
the split-KV kernel also with the index buffer of a captured CUDA graph (longer than the
batch's prefixes: it picks 16 splits from that length), and through the plugin's dispatch
with the split count by batch size (``split_kv_by_batch``, graph buffer;
``SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH``). Prints one JSON line per point:
the largest difference between the two outputs and against a float32 reference, and
each kernel's time per call and per verify of all layers (``LAYERS``, default 32),
called eagerly (``*_ms``) and replayed from a CUDA graph (``*_in_graph_ms``).
The scratch buffers are the plugin's zeroed ones (``compat.ZeroedSplitKVScratch``).
The grouped-head kernel (``SGLANG_DYNSPEC_GROUPED_VERIFY``: ``compat.grouped_verify``,
SGLang's where it ships one, else the plugin's copy) as the plugin runs it, with float32
partials (``grouped_*``), and with SGLang's bf16 partials (``grouped_bf16_*``).

    python3 benchmarks/h200/splitkv_check.py > $OUT/splitkv.jsonl
    # a check of the script itself on a CPU (Triton's interpreter, small points, no times):
    TRITON_INTERPRET=1 DEVICE=cpu DTYPE=float32 POINTS="2:16 3:40" LAYERS=2 python benchmarks/h200/splitkv_check.py
"""

from __future__ import annotations

import json
import os

import torch
import triton.testing
from sglang.kernels.ops.attention import verify_splitkv
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

from sglang_dynspec import compat

HQ, HKV, D, DRAFT = 32, 8, 128, 4  # Llama-3.1-8B on one GPU, 4 draft tokens (topk 1)
LAYERS = int(os.environ.get("LAYERS", "32"))
DEVICE = os.environ.get("DEVICE", "cuda")
DTYPE = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
GRAPH_INDICES = 128 * 8192 if DEVICE == "cuda" else 4096  # a graph's index buffer: max batch x context
POINTS = os.environ.get(
    "POINTS", " ".join(f"{bs}:{p}" for bs in (1, 16, 64, 128) for p in (256, 512, 1024, 2048))
)


def reference(q, k, v, kb, vb, prefix_lens, kv_indices, scale):
    out, start, row = [], 0, 0
    for n in prefix_lens:
        idx = kv_indices[start : start + n]
        start += n
        keys = torch.cat([kb[idx], k[row : row + DRAFT]]).float().repeat_interleave(HQ // HKV, 1)
        values = torch.cat([vb[idx], v[row : row + DRAFT]]).float().repeat_interleave(HQ // HKV, 1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + DRAFT].float(), keys) * scale
        visible = torch.ones(DRAFT, n + DRAFT, dtype=torch.bool, device=q.device)
        visible[:, n:] = torch.tril(torch.ones(DRAFT, DRAFT, dtype=torch.bool, device=q.device))
        out.append(
            torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
        )
        row += DRAFT
    return torch.cat(out)


def point(bs: int, prefix: int) -> dict:
    torch.manual_seed(bs * 10007 + prefix)
    dev = DEVICE
    prefix_lens = [prefix] * bs
    pool = bs * prefix + 1024
    kb = torch.randn(pool, HKV, D, device=dev, dtype=DTYPE)
    vb = torch.randn(pool, HKV, D, device=dev, dtype=DTYPE)
    kv_indices = torch.randperm(pool, device=dev)[: bs * prefix]
    graph_indices = torch.cat([kv_indices, torch.zeros(GRAPH_INDICES, dtype=torch.int64, device=dev)])
    kv_indptr = torch.arange(0, (bs + 1) * prefix, prefix, dtype=torch.int32, device=dev)
    qo_indptr = torch.arange(0, (bs + 1) * DRAFT, DRAFT, dtype=torch.int32, device=dev)
    q = torch.randn(bs * DRAFT, HQ, D, device=dev, dtype=DTYPE)
    k = torch.randn(bs * DRAFT, HKV, D, device=dev, dtype=DTYPE)
    v = torch.randn(bs * DRAFT, HKV, D, device=dev, dtype=DTYPE)
    one = torch.ones(DRAFT, prefix + DRAFT, dtype=torch.bool, device=dev)
    one[:, prefix:] = torch.tril(torch.ones(DRAFT, DRAFT, dtype=torch.bool, device=dev))
    mask = one.flatten().repeat(bs)
    mask_indptr = torch.arange(0, (bs + 1) * DRAFT * (prefix + DRAFT), DRAFT * (prefix + DRAFT), device=dev)
    scale = D**-0.5
    split, graph_split, prefill, grouped, grouped_bf16, by_batch = (torch.empty_like(q) for _ in range(6))

    def kernel_args(out, indices):  # the two kernels take the same positional arguments
        return (
            q,
            k,
            v,
            out,
            kb,
            vb,
            qo_indptr,
            kv_indptr,
            indices,
            mask,
            True,
            mask_indptr,
            DRAFT,
            1.0,
            1.0,
            scale,
        )

    def run_split(out, indices):
        return lambda: verify_splitkv.verify_splitkv_fwd(*kernel_args(out, indices), max_bs=128)

    def run_by_batch():  # the plugin's split count by batch size, with a graph's index buffer
        return compat.per_head_verify_splits_by_batch(*kernel_args(by_batch, graph_indices), max_bs=128)

    def run_prefill():
        extend_attention_fwd(*kernel_args(prefill, kv_indices))

    def run_grouped(out, verify_class):
        def install():  # the kernel's cache builds its scratch from this module name
            compat.grouped_verify.VerifyMLA = verify_class
            compat.grouped_verify._VMLA_CACHE.clear()

        install()
        return lambda: compat.grouped_verify.verify_shared_kv_fwd(
            *kernel_args(out, graph_indices), max_bs=128
        )

    assert run_split(split, kv_indices)() and run_split(graph_split, graph_indices)() and run_by_batch()
    run_prefill()
    grouped_bf16_run = run_grouped(grouped_bf16, BF16_PARTIALS)
    assert grouped_bf16_run()
    grouped_run = run_grouped(grouped, compat.Float32PartialsGroupedVerify)
    assert grouped_run()
    ref = reference(q, k, v, kb, vb, prefix_lens, kv_indices, scale)
    times = {}
    if dev == "cuda":

        def timed(name, fn):
            # Eager (kernels plus the Python around them, which can exceed a small kernel's
            # time) and replayed from a CUDA graph, as the server's verify runs (kernels only).
            times[f"{name}_ms"] = triton.testing.do_bench(fn)
            times[f"{name}_in_graph_ms"] = triton.testing.do_bench_cudagraph(fn)

        timed("prefill_kernel", run_prefill)
        timed("split_kv", run_split(split, kv_indices))
        timed("split_kv_graph_indices", run_split(graph_split, graph_indices))
        timed("split_kv_by_batch", run_by_batch)
        timed("grouped", grouped_run)
        run_grouped(grouped_bf16, BF16_PARTIALS)  # its own scratch again, for its time
        timed("grouped_bf16", grouped_bf16_run)
    return {
        "bs": bs,
        "prefix": prefix,
        "split_vs_prefill": (split.float() - prefill.float()).abs().max().item(),
        "graph_split_vs_prefill": (graph_split.float() - prefill.float()).abs().max().item(),
        "split_vs_reference": (split.float() - ref).abs().max().item(),
        "by_batch_splits": compat.split_kv_splits(bs, HQ),
        "by_batch_vs_reference": (by_batch.float() - ref).abs().max().item(),
        "prefill_vs_reference": (prefill.float() - ref).abs().max().item(),
        "grouped_vs_reference": (grouped.float() - ref).abs().max().item(),
        "grouped_bf16_vs_reference": (grouped_bf16.float() - ref).abs().max().item(),
        "grouped_vs_prefill": (grouped.float() - prefill.float()).abs().max().item(),
        **{name: round(ms, 4) for name, ms in times.items()},
        **{name.replace("_ms", f"_x{LAYERS}_layers_ms"): round(ms * LAYERS, 3) for name, ms in times.items()},
    }


BF16_PARTIALS = compat.grouped_verify.VerifyMLA  # SGLang's class, before anything replaces it


def main() -> None:
    verify_splitkv.VerifySplitKV = compat.ZeroedSplitKVScratch
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(json.dumps({"device": device, "sglang": compat.SGLANG_VERSION, "layers": LAYERS}))
    for bs, prefix in (p.split(":") for p in POINTS.split()):
        print(json.dumps(point(int(bs), int(prefix))), flush=True)


if __name__ == "__main__":
    main()
