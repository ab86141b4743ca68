"""``gemm_all_reduce(a, b)``: ``c = a @ b; dist.all_reduce(c)``, with the communication of each finished band of
rows overlapped with the rest of the multiplication.

Row-parallel linear layer (K sharded): rank r holds ``a_r: [M, K/W]`` (its slice of the activations' features)
and ``b_r: [K/W, N]`` (its rows of the weight, or ``w_r.t()`` of an ``nn.Linear`` weight ``w_r: [N, K/W]``); every
rank gets ``c = sum_r a_r @ b_r: [M, N]``, row-major, in the input dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.ops import library
from flashoverlap.plan import Plan
from flashoverlap.runtime.calls import GEMM, GemmSpec, execute

OP = "gemm_all_reduce"


def gemm_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    plan: Plan | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """``a @ b`` summed over ``group``, as ``c = a @ b; dist.all_reduce(c, group=group)`` would return it.

    Args:
        a: ``[M, K]`` bf16 or fp16 (overlapped), or fp32 (matmul then the collective), this rank's K-shard of the
            input.
        b: ``[K, N]``, same dtype and device; may be the transposed view ``w.t()`` of an ``[N, K]`` weight.
        group: the process group (default: the world). CUDA tensors: an NCCL group, or for the P2P path any group
            (ranks sharing one GPU over gloo: ``flashoverlap.testing.spawn_on_one_gpu``).
        plan: a :class:`flashoverlap.Plan` for this shape and world size (default: the library's plan for it).
        path: ``"auto"`` (the given plan's path; else the path of a plan tuned for the shape; else on one node with
            peer access the P2P path, elsewhere NCCL; the reference for CPU tensors), ``"nccl"``, ``"p2p"`` (cuBLAS
            and copy engines over symmetric memory, one node), ``"ring"`` (the P2P schedule over NCCL send/recv) or
            ``"reference"`` (group by group, nothing overlapped; any backend).

    Returns:
        ``[M, N]`` row-major, the input dtype, identical on every rank of ``group``.
    """
    if library.needed(OP, (a, b), plan):
        return torch.ops.flashoverlap.gemm_all_reduce(a, b, library.group_name(group, OP), path)
    return execute(GEMM, GemmSpec(OP, "all_reduce", a, b, group, plan, path))[0]
