"""Speculative-decoding bookkeeping ops: cache locations, draft metadata, tree
construction and greedy tree verification.

Shapes and dtypes follow ``sgl-kernel/csrc/cpu/speculative_decoding.cpp``.
``req_to_token`` is ``[max_num_reqs, pool_len]`` int32: row ``r`` maps a request's
token positions to KV slots. Index tensors may be int32 or int64.
"""

from collections.abc import Iterator

import torch


def _ragged_segments(
    req_pool_indices: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor
) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(row, start, end, packed_offset)`` per request.

    Request ``i`` owns positions ``[start[i], end[i])`` of its ``req_to_token`` row
    and the packed range starting at the exclusive prefix sum of ``end - start``.
    E.g. start=[5, 2], end=[7, 5] -> packed offsets [0, 2], lengths [2, 3].
    """
    packed_offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        yield row, start, end, packed_offset
        packed_offset += end - start


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """Scatter freshly allocated slots into the map:
    ``req_to_token[row_i, start_i:end_i] = out_cache_loc[packed range of i]``."""
    for row, start, end, offset in _ragged_segments(req_pool_indices, start_offset, end_offset):
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """Gather slots out of the map (inverse of ``assign_req_to_token_pool_cpu``):
    ``out_cache_loc[packed range of i] = req_to_token[row_i, start_i:end_i]``."""
    for row, start, end, offset in _ragged_segments(req_pool_indices, start_offset, end_offset):
        out_cache_loc[offset : offset + end - start] = req_to_token[row, start:end].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
) -> None:
    """Read back the draft slots the allocator reserved: request ``i`` gets the
    ``topk * num_steps`` slots that follow its committed prefix."""
    width = topk * num_steps
    for i, (row, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * width : (i + 1) * width] = req_to_token[row, seq_len : seq_len + width].to(
            out_cache_loc.dtype
        )


def build_draft_decode_metadata_cpu(
    req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len
) -> torch.Tensor:
    """Return ``[num_seqs * topk, pool_len]``: row ``b * topk + k`` is request
    ``b``'s committed prefix followed by candidate ``k``'s ``num_steps`` draft
    slots (laid out at ``seq_len + k * num_steps`` in the request's own row).

    Only the first ``seq_len + num_steps`` entries of a row are defined; the rest
    are zero.
    """
    num_seqs = req_pool_indices.numel()
    expanded = torch.zeros((num_seqs * topk, pool_len), dtype=req_to_token.dtype)
    for b, (row, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        source = req_to_token[row]
        for k in range(topk):
            target = expanded[b * topk + k]
            target[:seq_len] = source[:seq_len]
            draft_start = seq_len + k * num_steps
            target[seq_len : seq_len + num_steps] = source[draft_start : draft_start + num_steps]
    return expanded


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """``bonus_tokens[i]`` = the last accepted token of request ``i``
    (``accept_lens`` counts the bonus token; rows are ``accept_stride`` wide)."""
    batch_size = accept_lens.numel()
    last = torch.arange(batch_size) * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[last].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Compact the accepted tokens' slots: ``out_cache_loc`` gathered at the
    entries of ``accept_index`` that are not -1, in order, written to the front
    of ``accept_out_cache_loc`` (the tail is left untouched)."""
    flat_index = accept_index.reshape(-1).to(torch.int64)
    accepted = flat_index[flat_index > -1]
    accept_out_cache_loc[: accepted.numel()] = out_cache_loc[accepted]


def _parent_node(node: int, parents: list, selected: list, topk: int) -> int:
    """Tree index of ``node``'s parent: 0 for the root, -1 when the parent slot
    was not selected (a malformed tree; the C++ kernel warns and skips it)."""
    group = selected[node - 1] // topk
    if group == 0:
        return 0
    parent_slot = parents[group]
    if parent_slot not in selected:
        return -1
    return selected.index(parent_slot) + 1


def build_tree_kernel_efficient_cpu(
    parent_list,  # [bs, topk * (depth - 1) + 1]: slot index of each expanded node, [b, 0] = -1
    selected_index,  # [bs, draft_token_num - 1]: sorted slot indices of the chosen drafts
    verified_seq_len,  # [bs]: committed prefix length
    tree_mask,  # out, bool: QLEN_ONLY [bs * n * n], FULL_MASK [sum(seq_len) * n + bs * n * n]
    positions,  # out [bs * n]: seq_len + depth of each node
    retrive_index,  # out [bs, n]: flat index b * n + i of node i
    retrive_next_token,  # out [bs, n], pre-filled with -1: first child
    retrive_next_sibling,  # out [bs, n], pre-filled with -1: next sibling
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
) -> None:
    """Build the verify tree of each request from the drafter's slot selection.

    Node 0 is the bonus token (root); node ``i >= 1`` is draft slot
    ``selected_index[b, i - 1]``. Slot ``s`` belongs to parent group ``s // topk``;
    group 0 is the root, group ``g > 0`` hangs under slot ``parent_list[b, g]``.
    Children are linked smallest index first, siblings in ascending order.
    Each mask row ``i`` is true on the root, on ``i`` and on its ancestors. In
    FULL_MASK mode only each row's last ``n`` columns are written: the caller
    pre-fills the prefix columns.
    """
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError(
            f"build_tree_kernel_efficient_cpu: tree_mask_mode {mode} "
            "(only FULL_MASK=0 and QLEN_ONLY=1 exist on CPU)"
        )
    n = draft_token_num
    parents = parent_list.tolist()
    selected = selected_index.tolist()
    seq_lens = verified_seq_len.tolist()
    flat_index = retrive_index.view(-1)
    next_token = retrive_next_token.view(-1)
    next_sibling = retrive_next_sibling.view(-1)
    flat_positions = positions.view(-1)

    mask_base = 0  # FULL_MASK rows of request b start after earlier requests' rows
    for b, seq_len in enumerate(seq_lens):
        off = b * n
        request = (parents[b], selected[b], topk)
        flat_index[off : off + n] = torch.arange(off, off + n)
        # Walking nodes high to low and pushing each at the head of its parent's
        # child list leaves every list in ascending order.
        for node in range(n - 1, 0, -1):
            parent = _parent_node(node, *request)
            if parent < 0:
                continue
            first_child = int(next_token[off + parent])
            next_token[off + parent] = node
            if first_child != -1:
                next_sibling[off + node] = first_child

        for node in range(n):
            if mode == 1:
                row_start = (off + node) * n
            else:
                row_start = mask_base + (seq_len + n) * node + seq_len
            row = tree_mask[row_start : row_start + n]
            row.fill_(False)
            row[0] = True
            node_depth = 0
            ancestor = node
            # A root-ward walk takes at most `depth` steps; the bound keeps a
            # malformed tree from looping forever.
            while ancestor > 0 and node_depth < depth:
                row[ancestor] = True
                node_depth += 1
                ancestor = _parent_node(ancestor, *request)
            flat_positions[off + node] = seq_len + node_depth
        mask_base += (seq_len + n) * n


def verify_tree_greedy_cpu(
    predicts,  # out [bs * n] int32: target token at each accepted flat index
    accept_index,  # out [bs, num_spec_step] int32, pre-filled with -1
    accept_token_num,  # out [bs] int32: accepted drafts (bonus excluded)
    candidates,  # [bs, n]: draft token of each node (node 0 = bonus token)
    retrive_index,  # [bs, n]: flat index of each node
    retrive_next_token,  # [bs, n]: first child, -1 = none
    retrive_next_sibling,  # [bs, n]: next sibling, -1 = none
    target_predict,  # [bs, n]: target argmax after each node
) -> None:
    """Accept the longest root path whose drafts equal the target's argmax.

    From the root, step to the first child (in sibling order) whose draft token
    equals the target's prediction after the current node; stop when none does
    or ``num_spec_step - 1`` drafts are accepted. ``accept_index`` receives the
    root and each accepted node's flat index; ``predicts`` receives the target
    token after every accepted node, including the last (the new bonus token).
    """
    batch_size, num_nodes = candidates.shape
    num_spec_step = accept_index.shape[1]
    cands = candidates.tolist()
    flat_of = retrive_index.tolist()
    first_child = retrive_next_token.tolist()
    sibling = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(batch_size):
        last_flat = flat_of[b][0]
        accept_index[b, 0] = last_flat
        num_accepted = 0
        node = 0
        for _ in range(1, num_spec_step):
            node = first_child[b][node]
            while node != -1 and cands[b][node] != target[last_flat]:
                node = sibling[b][node]
            if node == -1:
                break
            predicts[last_flat] = target[last_flat]
            num_accepted += 1
            accept_index[b, num_accepted] = flat_of[b][node]
            last_flat = flat_of[b][node]
        accept_token_num[b] = num_accepted
        predicts[last_flat] = target[last_flat]
