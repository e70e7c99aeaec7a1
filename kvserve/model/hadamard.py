"""The normalized Hadamard rotation that int8/int4 KV codecs apply before quantizing: it spreads K's
outlier channels over all of head_dim and keeps dot products."""

from __future__ import annotations

import torch


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., hd] times the normalized Hadamard matrix H (Sylvester's, block-diagonal in blocks of the
    largest power of two dividing hd), computed in float32. H is symmetric and orthogonal, so this is
    its own inverse and keeps dot products: (H q) . (H k) = q . k.

    Computed as log2(block) butterfly stages (a, b) -> (a + b, a - b), then one scaling: elementwise
    ops only, so a row's result never depends on how many rows come with it (a matmul's blocking
    does, for some head dims), and stored pages stay history-free."""
    hd = x.shape[-1]
    block = hd & -hd
    if block < 2:
        return x
    y = x.float().reshape(-1, block)
    half = 1
    while half < block:
        pairs = y.view(-1, block // (2 * half), 2, half)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).view(-1, block)
        half *= 2
    return (y * block**-0.5).view(x.shape).to(x.dtype)
