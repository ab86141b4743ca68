"""A tensor-parallel call as a value, every rank's operands made from seeds, and the oracle each rank computes
locally (no collective, none of the library's code): the sum (or gather) of every rank's plain product in fp32.

``TpCall`` names a public op (bf16/fp16: ``gemm_all_reduce``, ``gemm_reduce_scatter``, ``all_gather_gemm``; fp8:
``scaled_gemm_all_reduce``, ``scaled_gemm_reduce_scatter``, ``all_gather_scaled_gemm``), its dtype (``"bf16"``,
``"fp16"``; fp8: the scaling mode ``"tensor"``, ``"row"``, ``"block"``), the op's ``M, N, K`` (all-gather: the
gathered ``M``), ``b``'s layout (``w.t()`` or row-major) and the plan: ``"given"`` (the P2P path's default plan at a
small tile height, ``given_plan``, passed as ``plan=``) or ``"default"`` (``plan=None``: the runtime's own).

Why an explicit plan: the P2P all-reduce cuts ``C`` into ``W`` rank blocks of whole tile rows, so its default plan
(128-row tiles) is the sequential one below ``M = 128 (W - 1) + 1`` (and at every shape the default rule makes small,
under 4 MB of output or two waves of tiles), and a sequential plan needs NCCL. With 16-row tiles the P2P plan exists
from ``M = 16 (W - 1) + 1`` (all-reduce) and from ``M = W`` (reduce-scatter, all-gather).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
BLOCK = 128
# public op -> the plan's kind
TP_OPS = {
    "gemm_all_reduce": "all_reduce",
    "gemm_reduce_scatter": "reduce_scatter",
    "all_gather_gemm": "all_gather",
    "scaled_gemm_all_reduce": "all_reduce",
    "scaled_gemm_reduce_scatter": "reduce_scatter",
    "all_gather_scaled_gemm": "all_gather",
}
HALF_OPS = ("gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm")
FP8_OPS = ("scaled_gemm_all_reduce", "scaled_gemm_reduce_scatter", "all_gather_scaled_gemm")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP8_MODES = ("tensor", "row", "block")
OUT = {"bf16": torch.bfloat16, "fp32": torch.float32}
SMALL_TILE_M = 16  # the given plans' tile height (the P2P path's bands are whole tile rows)


@dataclass(frozen=True)
class TpCall:
    """One tensor-parallel call (see the module docstring). ``out``, ``bias``: fp8 only (output dtype, a bias on
    every rank's product); ``sub_bands``: the given plan's sub-bands per rank block (fewer where the shape has too
    few tile rows); ``gathered``: all_gather_gemm also returns the gathered input; ``seed``: of every rank's
    operands."""

    op: str
    dtype: str
    m: int
    n: int
    k: int
    transposed: bool = True
    out: str = "bf16"
    bias: bool = False
    plan: str = "given"
    sub_bands: int = 1
    gathered: bool = False
    seed: int = 0

    @property
    def kind(self) -> str:
        return TP_OPS[self.op]

    @property
    def fp8(self) -> bool:
        return self.op in FP8_OPS

    def rows(self, world: int) -> int:
        """Rows of this rank's ``a`` (all-gather: its shard)."""
        return self.m // world if self.kind == "all_gather" else self.m

    def out_rows(self, world: int) -> int:
        return self.m // world if self.kind == "reduce_scatter" else self.m

    def label(self) -> str:
        b = "b=w.t()" if self.transposed else "b row-major"
        extra = f" out={self.out}{'+bias' if self.bias else ''}" if self.fp8 else ""
        return f"{self.op} {self.dtype} {self.m}x{self.n}x{self.k} {b}{extra} plan={self.plan}/{self.sub_bands}"

    def problem(self, world: int) -> str | None:
        """Why this call cannot run on the P2P path at ``world`` ranks (None: it can)."""
        if self.op not in TP_OPS:
            return f"unknown op {self.op!r}"
        if self.fp8 and self.dtype not in FP8_MODES or not self.fp8 and self.dtype not in HALF:
            return f"dtype {self.dtype!r} does not fit {self.op}"
        if min(self.m, self.n, self.k) < 1:
            return "a dimension < 1"
        if self.kind != "all_reduce" and self.m % world:
            return f"M = {self.m} not divisible by {world}"
        if self.fp8 and self.dtype == "block" and self.k % BLOCK:
            return f"block-wise needs K % {BLOCK} == 0"
        if self.plan == "given":
            try:
                given_plan(self, world)
            except ValueError as exc:
                return str(exc)
        return None


@functools.lru_cache(maxsize=4096)
def _p2p_plan(kind: str, m: int, n: int, k: int, world: int, sub_bands: int):
    from flashoverlap.plan import TileConfig
    from flashoverlap.tune.defaults import default_plan

    tile = TileConfig(block_m=SMALL_TILE_M, block_n=64, block_k=64)
    for groups in (sub_bands, None):
        plan = default_plan(kind, m, n, k, world, path="p2p", allow_sequential=False, tile=tile, num_groups=groups)
        if not plan.sequential:
            return plan
    raise ValueError(f"no overlapped P2P plan for {kind} {m}x{n}x{k} at W = {world} (all-reduce needs M > "
                     f"{SMALL_TILE_M} * (W - 1))")


def given_plan(call: TpCall, world: int):
    """The explicit plan of a ``plan="given"`` call (``default_plan(path="p2p", allow_sequential=False)`` with
    16-row tiles); None for ``plan="default"``. Raises ValueError where no overlapped P2P plan exists."""
    if call.plan != "given":
        return None
    return _p2p_plan(call.kind, call.m, call.n, call.k, world, call.sub_bands)


def min_all_reduce_m(world: int) -> int:
    """The smallest M a given P2P all-reduce plan takes (every rank block one tile row at least)."""
    return SMALL_TILE_M * (world - 1) + 1


def default_is_overlapped(call: TpCall, world: int, num_sms: int = 132) -> bool:
    """Whether the library's default P2P plan for this call (no tuned plan) is an overlapped one, as
    ``runtime/plans.py`` builds it (bf16/fp16: ``default_plan``; fp8: ``fp8_plan``): where it is not, the call runs
    the sequential plan, which needs NCCL."""
    from flashoverlap.tune.defaults import default_plan
    from flashoverlap.tune.fp8 import fp8_plan

    if call.fp8:
        plan = fp8_plan(call.kind, call.m, call.n, call.k, world, call.dtype, path="p2p", num_sms=num_sms,
                        out_size=OUT[call.out].itemsize)
    else:
        plan = default_plan(call.kind, call.m, call.n, call.k, world, num_sms=num_sms,
                            element_size=HALF[call.dtype].itemsize, path="p2p")
    return not plan.sequential


# -- operands -------------------------------------------------------------------------------------------------------


def _seed(*parts: int) -> int:
    value = 0x9E3779B1
    for part in parts:
        value = (value * 1_000_003 + int(part) + 7) % (1 << 62)
    return value


def generator(device: torch.device | str, *parts: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(_seed(*parts))


def quantise(x: torch.Tensor, mode: str, operand: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32) as e4m3 and its fp32 scales (``operand`` "a": ``[M, K]``, per row or per 1x128 block; "b":
    ``[K, N]``, per column or per 128x128 block); tensor-wise one scale."""
    top = torch.finfo(E4M3).max
    if mode == "tensor":
        s = x.abs().amax().clamp(min=1e-6) / top
        return (x / s).to(E4M3), s.float()
    if mode == "row":
        s = x.abs().amax(1 if operand == "a" else 0, keepdim=True).clamp(min=1e-6) / top
        return (x / s).to(E4M3), s.float()
    if operand == "a":
        blocks = x.reshape(x.shape[0], x.shape[1] // BLOCK, BLOCK)  # (not -1: a rank may have no rows)
        s = blocks.abs().amax(2).clamp(min=1e-6) / top
        return (blocks / s[:, :, None]).reshape(x.shape).to(E4M3), s.float()
    k, n = x.shape
    pad = -n % BLOCK
    s = (torch.nn.functional.pad(x, (0, pad)).reshape(k // BLOCK, BLOCK, -1, BLOCK).abs().amax((1, 3))
         .clamp(min=1e-6) / top)
    return (x / s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:, :n]).to(E4M3), s.float()


def dequantised(x: torch.Tensor, scale: torch.Tensor, mode: str, operand: str) -> torch.Tensor:
    """``x`` fp8 times its scales, fp32 (written out here, not the library's)."""
    x32, s = x.float(), scale.float()
    if mode == "tensor":
        return x32 * s.reshape(())
    if mode == "row":
        return x32 * (s.reshape(-1, 1) if operand == "a" else s.reshape(1, -1))
    if operand == "a":
        return x32 * s.repeat_interleave(BLOCK, 1)[:, : x.shape[1]]
    return x32 * s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: x.shape[0], : x.shape[1]]


@dataclass
class Operands:
    """One rank's tensors of a call: ``a``, ``b`` (half: ``scale_a`` etc. None), fp8 ``scale_a``, ``scale_b``,
    ``bias``."""

    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor | None = None
    scale_b: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def weights(call: TpCall, world: int, rank: int, device) -> Operands:
    """Rank ``rank``'s ``b`` (with its scale and the bias), the same for every call index."""
    gen = generator(device, call.seed, rank, 1)
    n, k = call.n, call.k
    if not call.fp8:
        dtype = HALF[call.dtype]
        if call.transposed:
            b = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(dtype).t()
        else:
            b = (torch.randn(k, n, device=device, generator=gen) / k**0.5).to(dtype)
        return Operands(None, b)
    w = torch.randn(n, k, device=device, generator=gen) / k**0.5
    b, scale_b = quantise(w.t().contiguous(), call.dtype, "b")  # [K, N] row-major
    if call.transposed:
        b = b.t().contiguous().t()  # column-major: w.t() of an [N, K] fp8 weight
    bias = torch.randn(n, device=device, generator=gen).to(OUT[call.out]) if call.bias else None
    return Operands(None, b, None, scale_b, bias)


def activations(call: TpCall, world: int, rank: int, index: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s ``a`` (and fp8 ``scale_a``) of call number ``index``."""
    gen = generator(device, call.seed, rank, 2, index)
    rows = call.rows(world)
    x = torch.randn(rows, call.k, device=device, generator=gen)
    if not call.fp8:
        return x.to(HALF[call.dtype]), None
    return quantise(x * (1 + rank), call.dtype, "a")


def operands(call: TpCall, world: int, rank: int, index: int, device) -> Operands:
    """Rank ``rank``'s whole operands of call number ``index``."""
    ops = weights(call, world, rank, device)
    ops.a, ops.scale_a = activations(call, world, rank, index, device)
    return ops


def product(call: TpCall, ops: Operands, a32: torch.Tensor | None = None) -> torch.Tensor:
    """One rank's plain product in fp32 (fp8: dequantised, with the bias), of ``a32`` where given (all-gather: the
    gathered input, dequantised)."""
    if not call.fp8:
        x = ops.a.float() if a32 is None else a32
        return x @ ops.b.float()
    x = dequantised(ops.a, ops.scale_a, call.dtype, "a") if a32 is None else a32
    c = x @ dequantised(ops.b, ops.scale_b, call.dtype, "b")
    return c if ops.bias is None else c + ops.bias.float()


def oracle(call: TpCall, everyone: list[Operands], rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``rank`` must get, in fp32, from every rank's operands (``everyone``, by rank): all-reduce, the sum of
    the products; reduce-scatter, its rows of the sum; all-gather, the gathered input times its own ``b`` (and the
    gathered input itself, for ``gathered``)."""
    world = len(everyone)
    if call.kind == "all_gather":
        if call.fp8:
            a32 = torch.cat([dequantised(o.a, o.scale_a, call.dtype, "a") for o in everyone])
        else:
            a32 = torch.cat([o.a.float() for o in everyone])
        want = product(call, everyone[rank], a32)
        full = torch.cat([o.a for o in everyone]) if call.gathered and not call.fp8 else None
        return want, full
    if call.kind == "reduce_scatter":  # only this rank's rows of every product (rows commute with the product)
        rows = slice(rank * (call.m // world), (rank + 1) * (call.m // world))
        everyone = [_rows_of(o, rows, call.m) for o in everyone]
    total = product(call, everyone[0])
    for ops in everyone[1:]:
        total = total + product(call, ops)
    return total, None


def _rows_of(ops: Operands, rows: slice, m: int) -> Operands:
    """``ops`` with only ``rows`` of ``a`` (and of its per-row or per-block scales; a tensor-wise scale as it is)."""
    scale = ops.scale_a
    if scale is not None and scale.ndim == 2 and scale.shape[0] == m:
        scale = scale[rows]
    return Operands(ops.a[rows], ops.b, scale, ops.scale_b, ops.bias)


def tolerance(call: TpCall) -> float:
    """The relative error (Frobenius) a correct result stays under: the output's rounding, and the ring's
    (W - 1 roundings of the running partial in the output dtype)."""
    out = OUT[call.out] if call.fp8 else HALF[call.dtype]
    return {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-3}[out]


def relative_error(got: torch.Tensor, want: torch.Tensor, scratch: torch.Tensor | None = None) -> float:
    """``|got - want| / |want|`` (Frobenius, fp32), NaN anywhere in ``got`` giving inf; inf on a shape mismatch.
    ``scratch``: an fp32 buffer of the shape, so that a check allocates nothing the size of the output (a replayed
    call's buffers then come back at the same addresses)."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    if got.numel() == 0:
        return 0.0
    if scratch is None:
        diff = got.float() - want
    else:
        diff = scratch.copy_(got).sub_(want)
    err = float(torch.linalg.vector_norm(diff))
    norm = float(torch.linalg.vector_norm(want))
    if math.isnan(err) or math.isinf(err):
        return math.inf
    return err / max(norm, 1e-30)


def invoke(call: TpCall, ops: Operands, group, plan, path: str):
    """The public op's call: ``(result, gathered input or None)``."""
    import flashoverlap as fo

    if call.fp8:
        fn = getattr(fo, call.op)
        out = fn(ops.a, ops.b, ops.scale_a, ops.scale_b, group, out_dtype=OUT[call.out], bias=ops.bias, path=path,
                 plan=plan)
        return out, None
    if call.op == "all_gather_gemm":
        if call.gathered:
            return fo.all_gather_gemm(ops.a, ops.b, group, plan=plan, path=path, return_gathered=True)
        return fo.all_gather_gemm(ops.a, ops.b, group, plan=plan, path=path), None
    return getattr(fo, call.op)(ops.a, ops.b, group, plan=plan, path=path), None
