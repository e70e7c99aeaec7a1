"""The normalized Hadamard rotation that int8/int4 KV codecs apply before quantizing: it spreads K's
outlier channels over all of head_dim and keeps dot products."""

from __future__ import annotations

import functools

import torch


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., hd] times the normalized Hadamard matrix H (block-diagonal, in blocks of the largest
    power of two dividing hd). H is symmetric and orthogonal, so this is its own inverse and keeps
    dot products: (H q) . (H k) = q . k. One matmul; its row results do not depend on how many rows
    it gets (the token-by-token tests pin that down), so stored pages stay history-free."""
    hd = x.shape[-1]
    block = hd & -hd
    if block < 2:
        return x
    h = _hadamard_matrix(block, x.device).to(x.dtype)
    return (x.reshape(-1, block) @ h).view(x.shape)


@functools.lru_cache(maxsize=16)
def _hadamard_matrix(block: int, device: torch.device) -> torch.Tensor:
    """The normalized block x block Hadamard matrix (Sylvester's construction): entries +-1/sqrt(block)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / block**0.5).float().to(device)
