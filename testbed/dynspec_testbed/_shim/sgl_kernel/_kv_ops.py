"""KV-cache slot moves."""

import ctypes

import torch


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [num_buffers] uint64: base address of each KV buffer
    strides: torch.Tensor,  # [num_buffers]: bytes per slot (row) of each buffer
    tgt_loc: torch.Tensor,  # [n] slot indices to write
    src_loc: torch.Tensor,  # [n] slot indices to read
) -> None:
    """For every buffer, copy slot ``src_loc[j]`` to slot ``tgt_loc[j]``.

    The real op takes raw addresses (``MHATokenToKVPool.data_ptrs``), not tensors,
    so each buffer is re-viewed as ``[rows, stride]`` bytes through ctypes. The
    advanced-index read copies all sources before any target is written, like
    the tiled Triton kernel, so overlapping moves (e.g. a swap) behave the same.
    """
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    # Only rows up to the largest index touched need to be mapped.
    num_rows = int(torch.maximum(src.max(), tgt.max()).item()) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (num_rows * int(row_bytes))).from_address(int(address))
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, int(row_bytes))
        rows[tgt] = rows[src]
