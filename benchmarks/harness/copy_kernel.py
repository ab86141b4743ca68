"""A copy kernel run by a few SMs: the SM-driven way of moving bytes to or from a peer's memory (symmetric
memory maps it into this device's address space), measured against copy engines (``harness/movers.py``).

Each program copies ``BLOCK``-element chunks, strided by the number of programs; the launcher takes the source
and destination as tensors of one dtype, either of which may be a peer-mapped view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def copy_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
    for start in tl.range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def sm_copy(dst: torch.Tensor, src: torch.Tensor, programs: int, block: int = 4096) -> None:
    """``dst.copy_(src)`` by ``programs`` CTAs of this kernel (both contiguous, same dtype and size)."""
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(f"sm_copy: dst and src must match, got {dst.dtype}[{dst.numel()}] and "
                         f"{src.dtype}[{src.numel()}]")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("sm_copy: dst and src must be contiguous")
    if programs < 1:
        raise ValueError(f"sm_copy: programs must be >= 1, got {programs}")
    copy_kernel[(programs,)](src, dst, src.numel(), BLOCK=block, num_warps=8)
