"""Stand-in for SGLang's CPU kernel build (`sgl-kernel` built from source for AMX Xeons).

No registry publishes that build and our CPUs have no AMX, so SGLang's CPU path runs on torch
everywhere except for the few names below, which it imports unguarded. Only
`assign_req_to_token_pool_cpu` is called when serving (every extend batch); the rest belong to
speculative decoding and KV-cache copies we do not enable, and raise if that ever changes.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request r (in order), write the next `end - start` entries of `out_cache_loc`
    into `req_to_token[req_pool_indices[r], start:end]`: the contract of SGLang's triton
    `assign_req_to_token_pool`."""
    del pool_len  # the row width, implied by req_to_token's shape
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    cursor = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[cursor : cursor + length].to(
            req_to_token.dtype
        )
        cursor += length


def _unavailable(name: str):
    def kernel(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is lorafleet's CPU stand-in "
            "(services/rollout/sglang_cpu_shims), which covers serving without "
            "speculative decoding or KV-cache copies"
        )

    kernel.__name__ = name
    return kernel


copy_all_layer_kv_cache_cpu = _unavailable("copy_all_layer_kv_cache_cpu")
assign_draft_cache_locs_contiguous_cpu = _unavailable("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unavailable("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _unavailable("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unavailable("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _unavailable("rotate_input_ids_cpu")
build_tree_kernel_efficient_cpu = _unavailable("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unavailable("verify_tree_greedy_cpu")
