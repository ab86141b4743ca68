"""Argument checks shared by the ops, and the one rule of which dtypes they take: every problem is a
ValueError/RuntimeError/TypeError naming the argument, raised before anything is launched."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm import scaled

# The dtypes of the bf16/fp16/fp32 ops' operands (float32 runs the matmul-then-collective plan on CUDA); the fp8
# ops' operands and output dtypes; a number per dtype that is the same on every rank (debug mode's agreement).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HALF_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = scaled.FP8  # the fp8 operand dtypes, as the scaled products define them
FP8_OUT_DTYPES = (torch.bfloat16, torch.float32)
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES + FP8_DTYPES, start=1)}
DTYPE_NAMES = ("none", *(str(dtype).removeprefix("torch.") for dtype in DTYPES + FP8_DTYPES))  # by code


def check_operands(op: str, a: object, b: object, a_name: str = "a") -> tuple[int, int, int]:
    """``a [M, K]`` and ``b [K, N]``: tensors of one supported dtype on one device (``a_name``: what the op calls
    ``a``, ``a_shard`` for the all-gathers). Returns ``(M, N, K)``."""
    _check_tensors(op, a, b, DTYPES, "bfloat16, float16 or float32 (float8 operands: the scaled_* ops)", a_name)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if a.dtype != b.dtype:
        raise ValueError(f"{op}: {a_name} and b must have the same dtype, got {a_name} {a.dtype} and b {b.dtype}")
    return _check_shapes(op, a, b, a_name)


def check_dense(op: str, name: str, t: torch.Tensor) -> None:
    """A strided (dense) tensor: sparse and other layouts have no strides for the kernels, the copies or the
    collectives to read."""
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {name} must be a dense tensor, got layout {t.layout} (call .to_dense() first)")


def _check_tensors(op: str, a: object, b: object, dtypes: tuple, described: str, a_name: str = "a") -> None:
    for name, t in ((a_name, a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        check_dense(op, name, t)
        if t.ndim != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {list(t.shape)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{op}: {name} must be {described}, got {t.dtype}")


def _check_shapes(op: str, a: torch.Tensor, b: torch.Tensor, a_name: str = "a") -> tuple[int, int, int]:
    if a.device != b.device:
        raise ValueError(f"{op}: {a_name} and b must be on the same device, got {a_name} on {a.device} and b on "
                         f"{b.device}")
    m, k = a.shape
    k_b, n = b.shape
    if k != k_b:
        raise ValueError(
            f"{op}: {a_name} is [M, K] = {list(a.shape)} and b is [K, N] = {list(b.shape)}: their K differ "
            f"({k} vs {k_b}); for an nn.Linear weight w [N, K] pass b = w.t()"
        )
    if min(m, n, k) < 1:
        raise ValueError(f"{op}: every dimension must be >= 1, got M={m}, N={n}, K={k}")
    return m, n, k


def check_scaled(op: str, a: object, b: object, scales: object, kind: str) -> tuple[int, int, int]:
    """An fp8 call (``comm/scaled.py``): ``a [M, K]`` and ``b [K, N]`` fp8 (not both e5m2, as in
    ``torch._scaled_mm``), fp32 scales whose shapes fit one mode, block-wise K a multiple of 128, the output
    dtype and the bias. ``kind``: the plan kind (all-gather's ``M`` is the shard's). Returns ``(M, N, K)``."""
    from flashoverlap.comm.scaled import BLOCK

    # The all-gather's arguments are the shard's: a_shard and scale_a_shard.
    a_name, sa_name = ("a_shard", "scale_a_shard") if kind == "all_gather" else ("a", "scale_a")
    _check_tensors(op, a, b, FP8_DTYPES, "float8_e4m3fn or float8_e5m2 (bf16/fp16/fp32 operands: the unscaled ops)",
                   a_name)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise ValueError(f"{op}: {a_name} and b are both float8_e5m2, which torch._scaled_mm does not multiply: make "
                         "one of them float8_e4m3fn (gradients: e5m2 with e4m3 weights)")
    m, n, k = _check_shapes(op, a, b, a_name)
    scale_a, scale_b = scales.a, scales.b
    for name, t in ((sa_name, scale_a), ("scale_b", scale_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        check_dense(op, name, t)
        if t.dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be float32, got {t.dtype}")
        if t.device != a.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {a_name} is on {a.device}")
    blocks_k, blocks_n = -(-k // BLOCK), -(-n // BLOCK)
    wanted = {"tensor": ((1,), (1,)), "row": ((m, 1), (1, n)), "block": ((m, blocks_k), (blocks_k, blocks_n))}
    shapes = (tuple(scale_a.shape), tuple(scale_b.shape))
    if scales.mode not in wanted or (scales.mode != "tensor" and shapes != wanted[scales.mode]):
        if shapes == wanted["block"] and k % BLOCK:  # block-wise shapes (read as row-wise where K < 128)
            raise ValueError(f"{op}: block-wise scaling needs K ({a_name}'s columns) a multiple of {BLOCK}, got K = "
                             f"{k} ({sa_name} [M, K/128], scale_b [K/128, ceil(N/128)]); or use row-wise scales")
        rows = "a_shard's rows" if kind == "all_gather" else "M"
        raise ValueError(
            f"{op}: {sa_name} {list(scale_a.shape)} and scale_b {list(scale_b.shape)} fit no scaling mode for "
            f"{a_name} [{m}, {k}] and b [{k}, {n}]: tensor-wise takes one value each, row-wise {sa_name} [{m}, 1] "
            f"({rows}) and scale_b [1, {n}], block-wise {sa_name} [{m}, {blocks_k}] (1x128 blocks) and scale_b "
            f"[{blocks_k}, {blocks_n}] (128x128 blocks; K a multiple of {BLOCK})")
    if scales.mode == "block" and k % BLOCK:
        raise ValueError(f"{op}: block-wise scaling needs K ({a_name}'s columns) a multiple of {BLOCK}, got K = {k}")
    if scales.out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be torch.bfloat16 or torch.float32, got {scales.out_dtype}")
    bias = scales.bias
    if isinstance(bias, torch.Tensor):
        check_dense(op, "bias", bias)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)
                             or bias.dtype != scales.out_dtype or bias.device != a.device):
        described = (f"{bias.dtype} {list(bias.shape)} on {bias.device}" if isinstance(bias, torch.Tensor)
                     else type(bias).__name__)
        raise ValueError(f"{op}: bias must be a [{n}] tensor of out_dtype {scales.out_dtype} on {a.device}, got "
                         f"{described}")
    return m, n, k


def refuse_non_group(op: str, group: object) -> None:
    """A TypeError naming ``op`` where ``group`` is neither a process group nor None (a DeviceMesh: its group)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        hint = " (a DeviceMesh: pass mesh.get_group())" if type(group).__name__ == "DeviceMesh" else ""
        raise TypeError(f"{op}: group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}{hint}")


def check_group(op: str, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group to use: initialised, and this rank a member. Whether its backend can move the call's
    tensors depends on the path (``runtime/policy.py``: P2P moves none through it)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialised; call dist.init_process_group() first")
    group = group if group is not None else dist.group.WORLD
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:  # dist.new_group, outside it
        raise ValueError(f"{op}: this rank (global {dist.get_rank()}) is not a member of group (dist.new_group "
                         "returned GroupMember.NON_GROUP_MEMBER here): call the op on the group's ranks only")
    refuse_non_group(op, group)
    if dist.get_rank(group) < 0:
        raise ValueError(f"{op}: this rank (global {dist.get_rank()}) is not a member of group")
    return group
