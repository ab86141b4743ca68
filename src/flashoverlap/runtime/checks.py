"""Argument checks shared by the ops: every problem is a ValueError/RuntimeError/TypeError naming the argument,
raised before anything is launched."""

from __future__ import annotations

import torch
import torch.distributed as dist

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_operands(op: str, a: object, b: object) -> tuple[int, int, int]:
    """``a [M, K]`` and ``b [K, N]``: tensors of one supported dtype on one device. Returns ``(M, N, K)``."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {list(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{op}: {name} must be bfloat16, float16 or float32, got {t.dtype}")
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if a.dtype != b.dtype:
        raise ValueError(f"{op}: a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{op}: a and b must be on the same device, got a on {a.device} and b on {b.device}")
    m, k = a.shape
    k_b, n = b.shape
    if k != k_b:
        raise ValueError(
            f"{op}: a is [M, K] = {list(a.shape)} and b is [K, N] = {list(b.shape)}: their K differ "
            f"({k} vs {k_b}); for an nn.Linear weight w [N, K] pass b = w.t()"
        )
    if min(m, n, k) < 1:
        raise ValueError(f"{op}: every dimension must be >= 1, got M={m}, N={n}, K={k}")
    return m, n, k


def check_group(op: str, group: dist.ProcessGroup | None, device: torch.device) -> dist.ProcessGroup:
    """The process group to use: initialised, and with a backend that can move tensors on ``device``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialised; call dist.init_process_group() first")
    group = group if group is not None else dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{op}: this rank (global {dist.get_rank()}) is not a member of group")
    if device.type == "cuda":
        backend = str(dist.get_backend(group)).lower()
        if "nccl" not in backend:
            raise ValueError(
                f"{op}: group has backend {backend!r} but the tensors are on {device}; CUDA tensors need an "
                "NCCL group (init_process_group('nccl') or new_group(backend='nccl'))"
            )
    return group
