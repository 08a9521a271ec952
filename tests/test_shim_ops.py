"""Unit tests of the pure-PyTorch ``sgl_kernel`` stand-in (test bed ``_shim``).

Each op is checked against an independent reference: hand-worked examples whose
expected values follow from the op's contract, naive loops, or
``torch.nn.functional.scaled_dot_product_attention``. The shim is loaded by file
path under a private name, so these tests neither need ``_shim`` on
``PYTHONPATH`` nor shadow a real ``sgl_kernel``.
"""

import importlib.util
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dynspec_testbed import SHIM_DIR

QLEN_ONLY, FULL_MASK = 1, 0


def _load_shim():
    package_dir = SHIM_DIR / "sgl_kernel"
    name = "sgl_kernel_stand_in_under_test"
    spec = importlib.util.spec_from_file_location(
        name, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


shim = _load_shim()


# --------------------------------------------------------------------------- stubs


def test_unimplemented_op_raises_naming_the_op():
    with pytest.raises(NotImplementedError, match="fused_experts_cpu"):
        shim.fused_experts_cpu(torch.zeros(1))


def test_unimplemented_op_in_submodule_raises_naming_the_op():
    from sgl_kernel_stand_in_under_test.allreduce import init_custom_ar

    with pytest.raises(NotImplementedError, match="allreduce.init_custom_ar"):
        init_custom_ar()


def test_submodule_lookup_falls_back_to_implemented_op():
    from sgl_kernel_stand_in_under_test.speculative import verify_tree_greedy_cpu

    assert verify_tree_greedy_cpu is shim.verify_tree_greedy_cpu


@pytest.mark.parametrize("name", shim.IMPLEMENTED_OPS)
def test_implemented_ops_are_real_functions(name):
    assert not isinstance(getattr(shim, name), shim.MissingOp)


def test_attention_ops_are_on_torch_ops_namespace_and_amx_probe_stays_off():
    assert torch.ops.sgl_kernel.decode_attention_cpu is shim.decode_attention_cpu
    assert torch.ops.sgl_kernel.extend_attention_cpu is shim.extend_attention_cpu
    # SGLang's cpu_has_amx_support() probes this op; it must stay absent.
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


# ------------------------------------------------------------------------ KV moves


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer_including_a_swap():
    torch.manual_seed(0)
    buffers = [torch.randn(16, 2, 4), torch.randn(16, 3).to(torch.bfloat16)]
    expected = [b.clone() for b in buffers]
    tgt = torch.tensor([3, 4, 9, 10], dtype=torch.int64)
    src = torch.tensor([4, 3, 0, 15], dtype=torch.int64)  # 3 <-> 4 is a swap
    for buf in expected:
        snapshot = buf.clone()
        for t, s in zip(tgt.tolist(), src.tolist()):
            buf[t] = snapshot[s]
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])

    shim.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)

    for got, want in zip(buffers, expected):
        assert torch.equal(got, want)


def test_copy_all_layer_kv_cache_with_no_locations_is_a_no_op():
    buf = torch.arange(8.0).view(4, 2)
    ptrs = torch.tensor([buf.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([buf.stride(0) * buf.element_size()])
    empty = torch.empty(0, dtype=torch.int64)
    shim.copy_all_layer_kv_cache_cpu(ptrs, strides, empty, empty)
    assert torch.equal(buf, torch.arange(8.0).view(4, 2))


# --------------------------------------------------------------- cache locations


def test_assign_req_to_token_pool_scatters_packed_slots_into_rows():
    req_to_token = torch.zeros(3, 6, dtype=torch.int32)
    shim.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 3], dtype=torch.int32),
        torch.tensor([3, 4], dtype=torch.int32),
        torch.tensor([10, 11, 12], dtype=torch.int64),
        6,
    )
    expected = torch.tensor([[0, 0, 0, 12, 0, 0], [0] * 6, [0, 10, 11, 0, 0, 0]], dtype=torch.int32)
    assert torch.equal(req_to_token, expected)


def test_assign_extend_cache_locs_gathers_packed_slots_and_leaves_tail():
    req_to_token = torch.arange(18, dtype=torch.int32).view(3, 6)
    out = torch.full((5,), -7, dtype=torch.int64)
    shim.assign_extend_cache_locs_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 4]),
        torch.tensor([3, 6]),
        out,
        6,
    )
    assert out.tolist() == [13, 14, 4, 5, -7]


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_extend_cache_locs_inverts_req_to_token_assignment(data):
    num_rows, pool_len = 4, 12
    rows = data.draw(st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=4, unique=True))
    starts, ends = [], []
    for _ in rows:
        start = data.draw(st.integers(0, pool_len))
        starts.append(start)
        ends.append(data.draw(st.integers(start, pool_len)))
    total = sum(e - s for s, e in zip(starts, ends))
    slots = torch.randperm(1000, generator=torch.Generator().manual_seed(total))[:total]
    req_to_token = torch.full((num_rows, pool_len), -1, dtype=torch.int32)
    args = (torch.tensor(rows), req_to_token, torch.tensor(starts), torch.tensor(ends))

    shim.assign_req_to_token_pool_cpu(*args, slots, pool_len)
    gathered = torch.empty(total, dtype=torch.int64)
    shim.assign_extend_cache_locs_cpu(*args, gathered, pool_len)

    assert torch.equal(gathered, slots)


def test_assign_draft_cache_locs_contiguous_reads_slots_after_the_prefix():
    req_to_token = torch.arange(30, dtype=torch.int32).view(3, 10)
    out = torch.empty(2 * 2 * 2, dtype=torch.int64)  # bs 2, topk 2, steps 2
    shim.assign_draft_cache_locs_contiguous_cpu(
        torch.tensor([1, 2]), req_to_token, torch.tensor([3, 5]), out, 10, 2, 2
    )
    assert out.tolist() == [13, 14, 15, 16, 25, 26, 27, 28]


def test_build_draft_decode_metadata_expands_each_candidate_row():
    # Request row 0: prefix slots 100..102, candidate 0 drafts 103 104, candidate 1 drafts 105 106.
    req_to_token = torch.zeros(2, 8, dtype=torch.int32)
    req_to_token[1, :7] = torch.tensor([100, 101, 102, 103, 104, 105, 106])
    table = shim.build_draft_decode_metadata_cpu(req_to_token, torch.tensor([1]), torch.tensor([3]), 2, 2, 8)
    assert table.shape == (2, 8) and table.dtype == torch.int32
    assert table[0, :5].tolist() == [100, 101, 102, 103, 104]
    assert table[1, :5].tolist() == [100, 101, 102, 105, 106]


def test_fill_bonus_tokens_picks_last_accepted_token_per_row():
    accept_tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int32)
    bonus = torch.zeros(2, dtype=torch.int32)
    shim.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([3, 1], dtype=torch.int32), bonus, 4)
    assert bonus.tolist() == [7, 9]


def test_fill_accept_out_cache_loc_compacts_accepted_slots_in_order():
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.tensor([50, 51, 52, 53, 54, 55], dtype=torch.int64)
    result = torch.full((6,), -9, dtype=torch.int64)
    shim.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, result)
    assert result.tolist() == [50, 52, 54, -9, -9, -9]


# ------------------------------------------------------------------- tree building
#
# Encoding used by EAGLE (`organize_draft_results`): draft "slots" are numbered
# over all steps (step 0: [0, topk), step i >= 1: topk + topk^2 (i-1) + [0, topk^2)).
# Slot s belongs to parent group s // topk; group 0 is the root, group g > 0 hangs
# under slot parent_list[g]. Node 0 of the verify tree is the bonus token; node
# i >= 1 is slot selected_index[i - 1] (sorted).


def _build_tree(parent_lists, selected, seq_lens, topk, depth, n, mode):
    bs = len(selected)
    if mode == QLEN_ONLY:
        tree_mask = torch.full((bs * n * n,), True)
    else:
        tree_mask = torch.full((sum(seq_lens) * n + bs * n * n,), True)
    positions = torch.empty(bs * n, dtype=torch.int64)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.int64)
    shim.build_tree_kernel_efficient_cpu(
        torch.tensor(parent_lists, dtype=torch.int64).view(bs, -1),
        torch.tensor(selected, dtype=torch.int64).view(bs, n - 1),
        torch.tensor(seq_lens, dtype=torch.int64),
        tree_mask,
        positions,
        retrieve[0],
        retrieve[1],
        retrieve[2],
        topk,
        depth,
        n,
        mode,
    )
    return tree_mask, positions, retrieve[0], retrieve[1], retrieve[2]


# topk 2, 3 steps: step-0 slots 0 1 (root children), step-1 slots 2..5 (groups 1, 2
# under slots 0, 1), step-2 slots 6..9 (groups 3, 4 under the expanded slots 2, 4).
TOPK2_PARENT_LIST = [-1, 0, 1, 2, 4]
# Chosen slots 0 1 2 6 -> nodes 1 2 3 4; tree: 0 -> {1, 2}, 1 -> 3, 3 -> 4.
TOPK2_SELECTED = [0, 1, 2, 6]
TOPK2_MASK = [
    [1, 0, 0, 0, 0],
    [1, 1, 0, 0, 0],
    [1, 0, 1, 0, 0],
    [1, 1, 0, 1, 0],
    [1, 1, 0, 1, 1],
]


def test_build_tree_topk2_hand_worked_qlen_only():
    mask, positions, index, next_token, next_sibling = _build_tree(
        [TOPK2_PARENT_LIST], [TOPK2_SELECTED], [10], topk=2, depth=3, n=5, mode=QLEN_ONLY
    )
    assert index.tolist() == [[0, 1, 2, 3, 4]]
    assert next_token.tolist() == [[1, 3, -1, 4, -1]]
    assert next_sibling.tolist() == [[-1, 2, -1, -1, -1]]
    assert positions.tolist() == [10, 11, 11, 12, 13]
    assert mask.view(5, 5).int().tolist() == TOPK2_MASK


def test_build_tree_full_mask_keeps_prefix_columns_and_offsets_second_request():
    # Request 1, same slot layout: slot 0 -> node 1, slot 2 (under slot 0) -> node 2,
    # slots 6 and 7 (both under slot 2) -> nodes 3 and 4. Tree: 0 -> 1 -> 2 -> {3, 4}.
    chain_parents = [-1, 0, 1, 2, 4]
    chain_selected = [0, 2, 6, 7]
    mask, positions, index, next_token, next_sibling = _build_tree(
        [TOPK2_PARENT_LIST, chain_parents],
        [TOPK2_SELECTED, chain_selected],
        [2, 3],
        topk=2,
        depth=3,
        n=5,
        mode=FULL_MASK,
    )
    # Request 0: 5 rows of (2 prefix + 5 tree) columns.
    request0 = mask[: 5 * 7].view(5, 7).int()
    assert request0[:, :2].tolist() == [[1, 1]] * 5
    assert request0[:, 2:].tolist() == TOPK2_MASK
    # Request 1 starts after request 0's rows: 5 rows of (3 + 5) columns.
    request1 = mask[5 * 7 :].view(5, 8).int()
    assert request1[:, :3].tolist() == [[1, 1, 1]] * 5
    assert request1[:, 3:].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 1],
    ]
    assert positions.tolist() == [2, 3, 3, 4, 5, 3, 4, 5, 6, 6]
    assert index.tolist()[1] == [5, 6, 7, 8, 9]
    assert next_token.tolist()[1] == [1, 2, 3, -1, -1]
    assert next_sibling.tolist()[1] == [-1, -1, -1, 4, -1]


def test_build_tree_topk1_is_a_chain():
    # topk 1, 3 steps: slots 0, 1, 2, each the only child of the previous one.
    mask, positions, _, next_token, next_sibling = _build_tree(
        [[-1, 0, 1]], [[0, 1, 2]], [7], topk=1, depth=3, n=4, mode=QLEN_ONLY
    )
    assert mask.view(4, 4).int().tolist() == torch.ones(4, 4).tril().int().tolist()
    assert positions.tolist() == [7, 8, 9, 10]
    assert next_token.tolist() == [[1, 2, 3, -1]]
    assert next_sibling.tolist() == [[-1, -1, -1, -1]]


def test_build_tree_rejects_bitpacked_mask_mode():
    with pytest.raises(NotImplementedError, match="tree_mask_mode 2"):
        _build_tree([[-1, 0, 1]], [[0, 1, 2]], [7], topk=1, depth=3, n=4, mode=2)


@st.composite
def draft_trees(draw):
    """A batch of EAGLE draft selections plus each tree as a parent array.

    Returns (topk, depth, n, parent_lists, selected, parents) where parents[b][i]
    is node i's parent (node 0 = root, parents[b][0] = -1).
    """
    topk = draw(st.integers(1, 3))
    depth = draw(st.integers(1, 4))
    num_slots = topk + topk * topk * (depth - 1)
    n = draw(st.integers(2, min(num_slots, 7) + 1))
    bs = draw(st.integers(1, 3))
    parent_lists, selected_lists, parents = [], [], []
    for _ in range(bs):
        parent_list = [-1] + list(range(topk)) if depth > 1 else []
        for step in range(1, depth - 1):
            first = topk + topk * topk * (step - 1)
            parent_list += draw(
                st.lists(
                    st.integers(first, first + topk * topk - 1),
                    min_size=topk,
                    max_size=topk,
                    unique=True,
                )
            )

        def parent_slot(slot, parent_list=parent_list):
            return None if slot < topk else parent_list[slot // topk]

        chosen = set()
        while len(chosen) < n - 1:
            open_slots = sorted(
                s
                for s in range(num_slots)
                if s not in chosen and (parent_slot(s) is None or parent_slot(s) in chosen)
            )
            chosen.add(draw(st.sampled_from(open_slots)))
        selected = sorted(chosen)
        node_of = {slot: i + 1 for i, slot in enumerate(selected)}
        tree = [-1] + [0 if parent_slot(slot) is None else node_of[parent_slot(slot)] for slot in selected]
        parent_lists.append(parent_list)
        selected_lists.append(selected)
        parents.append(tree)
    return topk, depth, n, parent_lists, selected_lists, parents


def _ancestors_or_self(tree, node):
    chain = []
    while node > 0:
        chain.append(node)
        node = tree[node]
    return chain


def _children(tree, node):
    return [c for c in range(1, len(tree)) if tree[c] == node]


@settings(max_examples=150, deadline=None)
@given(draft_trees(), st.sampled_from([QLEN_ONLY, FULL_MASK]), st.data())
def test_build_tree_matches_parent_array_semantics(trees, mode, data):
    topk, depth, n, parent_lists, selected, parents = trees
    seq_lens = [data.draw(st.integers(0, 5)) for _ in parents]
    mask, positions, index, next_token, next_sibling = _build_tree(
        parent_lists, selected, seq_lens, topk, depth, n, mode
    )
    mask_row_base = 0
    for b, (tree, seq_len) in enumerate(zip(parents, seq_lens)):
        assert index[b].tolist() == list(range(b * n, (b + 1) * n))
        for node in range(n):
            lineage = _ancestors_or_self(tree, node)
            assert positions[b * n + node] == seq_len + len(lineage)
            if mode == QLEN_ONLY:
                row = mask[(b * n + node) * n : (b * n + node + 1) * n]
            else:
                full_row = mask[mask_row_base + node * (seq_len + n) :][: seq_len + n]
                assert full_row[:seq_len].all()
                row = full_row[seq_len:]
            visible = {i for i in range(n) if row[i]}
            assert visible == {0, *lineage}
            # Children linked smallest first, siblings ascending.
            kids = _children(tree, node)
            linked, cur = [], int(next_token[b, node])
            while cur != -1:
                linked.append(cur)
                cur = int(next_sibling[b, cur])
            assert linked == kids
        mask_row_base += n * (seq_len + n)


# ---------------------------------------------------------------- greedy verify


def _linkage(tree):
    """first-child / next-sibling arrays (ascending order) from a parent array."""
    n = len(tree)
    first_child, next_sibling = [-1] * n, [-1] * n
    for node in range(n):
        kids = _children(tree, node)
        if kids:
            first_child[node] = kids[0]
            for a, b in zip(kids, kids[1:]):
                next_sibling[a] = b
    return first_child, next_sibling


def _verify(trees, candidates, target_predict, num_spec_step):
    bs, n = len(trees), len(trees[0])
    linkage = [_linkage(t) for t in trees]
    predicts = torch.full((bs * n,), -5, dtype=torch.int32)
    accept_index = torch.full((bs, num_spec_step), -1, dtype=torch.int32)
    accept_num = torch.full((bs,), -3, dtype=torch.int32)
    shim.verify_tree_greedy_cpu(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=torch.tensor(candidates, dtype=torch.int64),
        retrive_index=torch.arange(bs * n, dtype=torch.int64).view(bs, n),
        retrive_next_token=torch.tensor([f for f, _ in linkage], dtype=torch.int64),
        retrive_next_sibling=torch.tensor([s for _, s in linkage], dtype=torch.int64),
        target_predict=torch.tensor(target_predict, dtype=torch.int64),
    )
    return predicts.tolist(), accept_index.tolist(), accept_num.tolist()


TOPK2_TREE = [-1, 0, 0, 1, 3]  # 0 -> {1, 2}, 1 -> 3, 3 -> 4


def test_verify_accepts_matching_sibling_and_stops_at_leaf():
    # Target predicts 8 after the root: node 1 (7) misses, sibling node 2 (8) hits.
    # Node 2 is a leaf, so the walk stops with one accepted draft.
    predicts, accept_index, accept_num = _verify(
        [TOPK2_TREE], [[99, 7, 8, 9, 5]], [[8, 1, 4, 1, 1]], num_spec_step=4
    )
    assert accept_index == [[0, 2, -1, -1]]
    assert accept_num == [1]
    assert predicts == [8, -5, 4, -5, -5]


def test_verify_accepts_full_path_and_bonus():
    predicts, accept_index, accept_num = _verify(
        [TOPK2_TREE], [[99, 7, 8, 9, 5]], [[7, 9, 0, 5, 6]], num_spec_step=4
    )
    assert accept_index == [[0, 1, 3, 4]]
    assert accept_num == [3]
    assert predicts == [7, 9, -5, 5, 6]


def test_verify_stops_at_num_spec_step_and_uses_flat_indices_per_request():
    predicts, accept_index, accept_num = _verify(
        [TOPK2_TREE, TOPK2_TREE],
        [[99, 7, 8, 9, 5], [99, 7, 8, 9, 5]],
        [[7, 9, 0, 5, 6], [3, 3, 3, 3, 3]],
        num_spec_step=3,
    )
    assert accept_index == [[0, 1, 3], [5, -1, -1]]
    assert accept_num == [2, 0]
    assert predicts[:5] == [7, 9, -5, 5, -5]
    assert predicts[5:] == [3, -5, -5, -5, -5]


@settings(max_examples=150, deadline=None)
@given(draft_trees(), st.data())
def test_verify_matches_greedy_walk_on_parent_array(trees, data):
    _, depth, n, _, _, parents = trees
    num_spec_step = depth + 1
    vocab = st.integers(0, 2)  # tiny vocabulary, so matches are frequent
    candidates = [data.draw(st.lists(vocab, min_size=n, max_size=n)) for _ in parents]
    target = [data.draw(st.lists(vocab, min_size=n, max_size=n)) for _ in parents]

    predicts, accept_index, accept_num = _verify(parents, candidates, target, num_spec_step)

    for b, tree in enumerate(parents):
        path = [0]
        while len(path) < num_spec_step:
            node = path[-1]
            match = [c for c in _children(tree, node) if candidates[b][c] == target[b][node]]
            if not match:
                break
            path.append(match[0])
        assert accept_num[b] == len(path) - 1
        flat = [b * n + node for node in path]
        assert accept_index[b] == flat + [-1] * (num_spec_step - len(path))
        for node in range(n):
            expected = target[b][node] if node in path else -5
            assert predicts[b * n + node] == expected


# -------------------------------------------------------------------- attention
#
# KV pool: [num_slots, num_kv_heads, head_dim] buffers; request rows of
# req_to_token are random slots, so a wrong index reads the wrong keys.

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
SCALING = 1 / math.sqrt(HEAD_DIM)


def _sdpa(q, k, v, keep):
    """q [Lq, H, D], k/v [Lk, Hkv, D], keep [Lq, Lk] or None -> [Lq, H, Dv] via torch SDPA."""
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=keep,
        scale=SCALING,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _paged_pool(kv_heads=KV_HEADS, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_buffer = torch.randn(64, kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v_buffer = torch.randn(64, kv_heads, HEAD_DIM, generator=gen).to(dtype)
    req_to_token = torch.randperm(64, generator=gen)[:48].view(3, 16).to(torch.int32)
    return k_buffer, v_buffer, req_to_token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_stores_new_kv_and_matches_sdpa(dtype):
    k_buffer, v_buffer, req_to_token = _paged_pool(dtype=dtype)
    rows, seq_lens = torch.tensor([2, 0]), torch.tensor([5, 9])
    cache_loc = req_to_token[rows, seq_lens - 1].to(torch.int64)
    q = torch.randn(2, HEADS, HEAD_DIM)
    new_k = torch.randn(2, KV_HEADS * HEAD_DIM)
    new_v = torch.randn(2, KV_HEADS * HEAD_DIM)
    o = torch.empty(2, HEADS, HEAD_DIM)

    shim.decode_attention_cpu(
        q,
        k_buffer,
        v_buffer,
        None,
        None,
        o,
        new_k,
        new_v,
        cache_loc,
        attn_logits=None,
        req_to_token=req_to_token,
        req_pool_indices=rows,
        seq_lens=seq_lens,
        scaling=SCALING,
        logit_cap=0.0,
    )

    stored_k = new_k.view(2, KV_HEADS, HEAD_DIM).to(dtype)
    stored_v = new_v.view(2, KV_HEADS, HEAD_DIM).to(dtype)
    assert torch.equal(k_buffer[cache_loc], stored_k)
    assert torch.equal(v_buffer[cache_loc], stored_v)
    for i, (row, seq_len) in enumerate(zip(rows.tolist(), seq_lens.tolist())):
        slots = req_to_token[row, :seq_len].long()
        want = _sdpa(q[i : i + 1], k_buffer[slots], v_buffer[slots], None)
        torch.testing.assert_close(o[i], want[0], rtol=1e-5, atol=1e-5)


# Two requests: row 1 with 7 tokens, row 2 with 5; the last ext_len of each are new.
EXTEND_ROWS, EXTEND_SEQ_LENS = [1, 2], [7, 5]


def _run_extend(ext_lens, pass_new_kv=True, tree_mask=None, is_causal=True):
    """Run the shim; return (output, reference(block_masks) -> SDPA output)."""
    k_buffer, v_buffer, req_to_token = _paged_pool()
    starts = [0, ext_lens[0]]
    new_slots = [
        req_to_token[row, seq_len - ext_len : seq_len].long()
        for row, seq_len, ext_len in zip(EXTEND_ROWS, EXTEND_SEQ_LENS, ext_lens)
    ]
    new_k = torch.cat([k_buffer[s] for s in new_slots]).flatten(1)
    new_v = torch.cat([v_buffer[s] for s in new_slots]).flatten(1)
    q = torch.randn(sum(ext_lens), HEADS, HEAD_DIM)
    o = torch.empty_like(q)
    shim.extend_attention_cpu(
        q,
        new_k if pass_new_kv else None,
        new_v if pass_new_kv else None,
        o,
        k_buffer,
        v_buffer,
        None,
        None,
        req_to_token,
        req_pool_indices=torch.tensor(EXTEND_ROWS),
        seq_lens=torch.tensor(EXTEND_SEQ_LENS),
        extend_seq_lens=torch.tensor(ext_lens),
        extend_start_loc=torch.tensor(starts),
        max_len_extend=max(ext_lens),
        scaling=SCALING,
        logit_cap=0.0,
        tree_mask=tree_mask,
        is_causal=is_causal,
    )

    def reference(block_masks):
        out = torch.empty_like(q)
        for row, seq_len, ext_len, start, block in zip(
            EXTEND_ROWS, EXTEND_SEQ_LENS, ext_lens, starts, block_masks
        ):
            slots = req_to_token[row, :seq_len].long()
            keep = torch.ones(ext_len, seq_len, dtype=torch.bool)  # prefix: all visible
            keep[:, seq_len - ext_len :] = block
            rows_of_request = slice(start, start + ext_len)
            out[rows_of_request] = _sdpa(q[rows_of_request], k_buffer[slots], v_buffer[slots], keep)
        return out

    return o, reference


@pytest.mark.parametrize("pass_new_kv", [True, False], ids=["new-kv-given", "new-kv-in-pool"])
def test_extend_attention_causal_matches_sdpa(pass_new_kv):
    o, reference = _run_extend((3, 4), pass_new_kv=pass_new_kv)
    causal = [torch.ones(e, e, dtype=torch.bool).tril() for e in (3, 4)]
    torch.testing.assert_close(o, reference(causal), rtol=1e-5, atol=1e-5)


def test_extend_attention_non_causal_sees_all_extend_tokens():
    o, reference = _run_extend((3, 4), is_causal=False)
    full = [torch.ones(e, e, dtype=torch.bool) for e in (3, 4)]
    torch.testing.assert_close(o, reference(full), rtol=1e-5, atol=1e-5)


def test_extend_attention_uses_one_tree_mask_block_per_request():
    tree = torch.tensor(TOPK2_MASK, dtype=torch.bool)[:4, :4]
    other = torch.ones(4, 4, dtype=torch.bool).tril()
    other[3] = torch.tensor([True, False, False, True])
    o, reference = _run_extend((4, 4), tree_mask=torch.cat([tree.flatten(), other.flatten()]))
    torch.testing.assert_close(o, reference([tree, other]), rtol=1e-5, atol=1e-5)


def _naive_attention(q, k, v, logit_cap, visible, sink):
    """One query, one head, by explicit loops: the definition of capped softmax
    attention with a sink logit in the denominator."""
    logits = []
    for j in range(k.shape[0]):
        if not visible(j):
            continue
        score = sum(float(q[d]) * float(k[j, d]) for d in range(q.shape[0])) * SCALING
        logits.append((j, logit_cap * math.tanh(score / logit_cap)))
    denominator = sum(math.exp(s) for _, s in logits) + math.exp(sink)
    out = torch.zeros(v.shape[1])
    for j, s in logits:
        out += math.exp(s) / denominator * v[j]
    return out


def test_decode_attention_logit_cap_sinks_and_sliding_window_match_naive_loops():
    seq_len, window, logit_cap = 6, 2, 2.0
    k_buffer, v_buffer, req_to_token = _paged_pool(kv_heads=1)
    q = torch.randn(1, 2, HEAD_DIM) * 3  # large scores, so the cap matters
    sinks = torch.tensor([0.5, -1.0])
    o = torch.empty(1, 2, HEAD_DIM)
    shim.decode_attention_cpu(
        q,
        k_buffer,
        v_buffer,
        None,
        None,
        o,
        None,
        None,
        None,
        attn_logits=None,
        req_to_token=req_to_token,
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([seq_len]),
        scaling=SCALING,
        logit_cap=logit_cap,
        sliding_window_plus1=window + 1,
        sinks=sinks,
    )
    slots = req_to_token[0, :seq_len].long()
    for head in range(2):
        want = _naive_attention(
            q[0, head],
            k_buffer[slots, 0],
            v_buffer[slots, 0],
            logit_cap,
            visible=lambda j: j >= seq_len - 1 - window,
            sink=float(sinks[head]),
        )
        torch.testing.assert_close(o[0, head], want, rtol=1e-5, atol=1e-5)


def test_attention_rejects_cross_attention():
    with pytest.raises(NotImplementedError, match="cross-attention"):
        shim.decode_attention_cpu(*([None] * 15), is_cross_attention=True)
