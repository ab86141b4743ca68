"""Thin wrappers over ``torch.distributed`` collectives that differ between the torch versions we support."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``dist.reduce_scatter_tensor``: torch >= 2.13 deprecates the name for ``reduce_scatter_single``, which
    torch 2.11 (the GPU machines') does not have."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(out, inp, group=group)
