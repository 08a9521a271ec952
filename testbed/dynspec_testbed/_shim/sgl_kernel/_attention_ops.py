"""Paged decode and extend attention over SGLang's KV pool, as called by
``IntelAMXAttnBackend`` (argument order of ``decode_attention_cpu`` and
``extend_attention_cpu`` in ``intel_amx_backend.py``).

KV buffers are ``[num_slots, num_kv_heads, head_dim]``; request ``i``'s keys are
the slots ``req_to_token[req_pool_indices[i], :seq_lens[i]]``. Scores are computed
in float32 per request. Grouped-query attention repeats each KV head over its
query heads. ``sliding_window_plus1`` is the layer's ``sliding_window_size + 1``
(0 = no window): a query at position p sees keys at positions
``>= p - sliding_window_size``.
"""

import torch


def _reject_cross_attention(is_cross_attention: bool) -> None:
    if is_cross_attention:
        raise NotImplementedError("sgl_kernel stand-in: cross-attention (encoder_lens) is not implemented")


def _window_keep(
    keep: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, window_plus1: int
) -> torch.Tensor:
    if window_plus1 and window_plus1 > 0:
        window = window_plus1 - 1
        keep = keep & (key_pos.view(1, -1) >= query_pos.view(-1, 1) - window)
    return keep


def _attend(
    q: torch.Tensor,  # [num_queries, num_heads, head_dim]
    k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim], float32
    v: torch.Tensor,  # [num_keys, num_kv_heads, v_head_dim], float32
    scaling: float,
    logit_cap: float,
    keep: torch.Tensor,  # [num_queries, num_keys] bool, True = visible
    sinks: torch.Tensor | None,  # [num_heads] per-head sink logit, or None
) -> torch.Tensor:  # [num_queries, num_heads, v_head_dim], float32
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scaling
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~keep.unsqueeze(0), float("-inf"))
    if sinks is not None:
        # A sink is an extra logit per head that takes probability mass but has
        # no value vector (gpt-oss style).
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _gather(buffer: torch.Tensor, slots: torch.Tensor, scale: float | None) -> torch.Tensor:
    return buffer[slots.to(torch.int64)].float() * (scale or 1.0)


def decode_attention_cpu(
    q,  # [bs, num_heads, head_dim]: one query per row
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    o,  # out [bs, num_heads, v_head_dim]
    k,  # [bs, ...] new keys to store at cache_loc first, or None
    v,
    cache_loc,  # [bs] slots of the new keys
    attn_logits,  # split-KV scratch of the C++ kernel; not needed here
    req_to_token,
    req_pool_indices,
    seq_lens,  # [bs], including the new token
    scaling,
    logit_cap,
    is_cross_attention=False,
    sliding_window_plus1=0,
    encoder_lens=None,
    sinks=None,
) -> None:
    """Store the new token's K/V (when given), then attend each query (at
    position ``seq_len - 1``) over its request's first ``seq_len`` slots."""
    _reject_cross_attention(is_cross_attention)
    if k is not None and v is not None:
        slots = cache_loc.to(torch.int64)
        k_buffer[slots] = k.reshape(slots.numel(), *k_buffer.shape[1:]).to(k_buffer.dtype)
        v_buffer[slots] = v.reshape(slots.numel(), *v_buffer.shape[1:]).to(v_buffer.dtype)
    for i, (row, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[row, :seq_len]
        keep = torch.ones((1, seq_len), dtype=torch.bool)
        keep = _window_keep(keep, torch.tensor([seq_len - 1]), torch.arange(seq_len), sliding_window_plus1)
        out = _attend(
            q[i : i + 1],
            _gather(k_buffer, slots, k_scale),
            _gather(v_buffer, slots, v_scale),
            scaling,
            logit_cap,
            keep,
            sinks,
        )
        o[i] = out[0].to(o.dtype)


def extend_attention_cpu(
    q_extend,  # [num_extend_tokens, num_heads, head_dim]
    k_extend,  # [num_extend_tokens, ...] keys of the extend tokens, or None (read from the pool)
    v_extend,
    o_extend,  # out [num_extend_tokens, num_heads, v_head_dim]
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    req_to_token,
    req_pool_indices,
    seq_lens,  # [bs], prefix + extend
    extend_seq_lens,  # [bs]
    extend_start_loc,  # [bs] first row of each request in q_extend
    max_len_extend,
    scaling,
    logit_cap,
    is_cross_attention=False,
    sliding_window_plus1=0,
    encoder_lens=None,
    sinks=None,
    tree_mask=None,  # QLEN_ONLY bool mask: one [ext_len, ext_len] block per request
    is_causal=True,
) -> None:
    """Attend each extend token over its request's cached prefix (always visible)
    and the extend tokens: by ``tree_mask`` when given (speculative verify),
    else causally, else (encoder-only) fully."""
    _reject_cross_attention(is_cross_attention)
    mask_offset = 0
    for row, seq_len, ext_len, start in zip(
        req_pool_indices.tolist(),
        seq_lens.tolist(),
        extend_seq_lens.tolist(),
        extend_start_loc.tolist(),
    ):
        prefix_len = seq_len - ext_len
        prefix_slots = req_to_token[row, :prefix_len]
        if k_extend is not None:
            new_k = k_extend[start : start + ext_len].reshape(ext_len, *k_buffer.shape[1:])
            new_v = v_extend[start : start + ext_len].reshape(ext_len, *v_buffer.shape[1:])
            new_k, new_v = new_k.float(), new_v.float()
        else:
            new_slots = req_to_token[row, prefix_len:seq_len]
            new_k = _gather(k_buffer, new_slots, k_scale)
            new_v = _gather(v_buffer, new_slots, v_scale)
        keys = torch.cat([_gather(k_buffer, prefix_slots, k_scale), new_k])
        values = torch.cat([_gather(v_buffer, prefix_slots, v_scale), new_v])

        keep = torch.ones((ext_len, seq_len), dtype=torch.bool)
        if tree_mask is not None:
            block = tree_mask[mask_offset : mask_offset + ext_len * ext_len]
            keep[:, prefix_len:] = block.view(ext_len, ext_len).bool()
            mask_offset += ext_len * ext_len
        elif is_causal:
            keep[:, prefix_len:] = torch.ones((ext_len, ext_len), dtype=torch.bool).tril()
        keep = _window_keep(
            keep, torch.arange(prefix_len, seq_len), torch.arange(seq_len), sliding_window_plus1
        )
        out = _attend(q_extend[start : start + ext_len], keys, values, scaling, logit_cap, keep, sinks)
        o_extend[start : start + ext_len] = out.to(o_extend.dtype)
