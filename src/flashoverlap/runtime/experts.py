"""The expert-parallel (MoE) ops' strategy on the one call pipeline (``runtime/calls.py``): ``layout`` checks the
routing and builds the layer's ``Layout`` (``comm/expert/``); ``EXPERT`` checks a call's operands against the
layout and the weights (on every call: the layout changes from call to call; but a bounded-mode call on the tensors of
a replayed one, layout included, takes the replay lane, ``ExpertKind.lane_key``), resolves the path
(``policy.expert_path``) and the plan (``ExpertPlan``) once per signature, and builds the ``ExpertCall`` that
``context.communicator("expert", path)`` runs.

Every check raises before anything is sent, naming the argument. With the agreement check on
(``FLASHOVERLAP_DEBUG_TIMEOUT`` or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) the ranks first agree on the call: the same
op, experts, widths, top-k, mode, bound, dtype and path, and counts that match (what rank s sends to rank r is what
r's layout expects from s); a disagreement raises on every rank, naming the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashoverlap import guards, settings
from flashoverlap.comm.expert import MODES, ExpertCall, ExpertPlan, Layout, check_out, default_bound, expert_layout
from flashoverlap.comm.expert.scaled import FP8, ExpertScales, rows_dtype
from flashoverlap.comm.expert.scaled import MODES as SCALED_MODES
from flashoverlap.comm.protocol import Hook
from flashoverlap.runtime import agreement, calls, plans, policy
from flashoverlap.runtime.checks import DTYPE_CODES, DTYPE_NAMES, DTYPES, check_dense
from flashoverlap.runtime.context import COMMUNICATORS, GroupContext, group_context, resolved_group
from flashoverlap.tune import grouped, grouped_fp8

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


# -- the layout ------------------------------------------------------------------------------------------------


def layout(name: str, topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None, mode: str = "exact",
           bound: int | None = None, topk_weights: torch.Tensor | None = None) -> Layout:
    """The checked routing layout of one layer (collective): ``topk_idx [T, k]`` integer, ``num_experts``
    divisible by the group's size, ``mode`` ``"exact"`` or ``"bounded"`` (``bound`` default: ``T * k``, the worst
    case; the same on every rank)."""
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"{name}: topk_idx must be a torch.Tensor [T, k], got {type(topk_idx).__name__}")
    check_dense(name, "topk_idx", topk_idx)
    if topk_idx.ndim != 2 or topk_idx.dtype not in _INT_DTYPES:
        raise ValueError(f"{name}: topk_idx must be a 2-D integer tensor [T, k] (expert indices), got "
                         f"{topk_idx.dtype} of shape {list(topk_idx.shape)}")
    if mode not in MODES:
        raise ValueError(f"{name}: mode must be one of {MODES}, got {mode!r}")
    try:
        if isinstance(num_experts, bool):
            raise TypeError
        num_experts = operator.index(num_experts)  # a NumPy or 0-d torch integer as the int it holds
    except TypeError:
        raise TypeError(f"{name}: num_experts must be an int, got {type(num_experts).__name__} {num_experts!r}") \
            from None
    context = group_context(name, group, topk_idx.device)
    world = context.world_size
    if num_experts < 1 or num_experts % world:
        raise ValueError(f"{name}: num_experts must be a positive multiple of the group's {world} ranks (each "
                         f"holds num_experts / {world}), got {num_experts!r}")
    tokens, top_k = topk_idx.shape
    if top_k < 1 or top_k > num_experts:
        raise ValueError(f"{name}: topk_idx is [T, k] = {list(topk_idx.shape)}: k must lie in [1, num_experts = "
                         f"{num_experts}]")
    if topk_weights is not None:
        _check_router_weights(name, topk_weights, topk_idx.shape, topk_idx.device)
    if mode == "bounded":
        bound = default_bound(tokens, top_k) if bound is None else bound
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:  # True is no row count
            raise ValueError(f"{name}: bound must be an int >= 1 (rows one rank may send another), got {bound!r}")
    elif bound is not None:
        raise ValueError(f"{name}: bound={bound} applies to mode='bounded' only; mode='exact' exchanges the counts")
    if mode == "exact":
        guards.refuse_inside_capture(f"{name}: mode='exact' synchronises with the host (the split sizes); use "
                                     "mode='bounded' inside a CUDA graph, which")
    env = settings.current()
    debug = env.agreement is not None  # debug mode: the ranks agree on every call, mode and bound included
    # CPU routing on a group of several ranks: on every call too (the reference path's rule: its collectives block
    # the host anyway), the mode and the bound left to expert_layout's own exchange, which checks them on every call
    # and names both.
    every = debug or calls.agree_every_call(topk_idx, "auto", group)
    if not guards.capturing():  # else on the group's first layout of these experts and top-k
        header = [0, num_experts, 0, 0, top_k, MODES.index(mode) * debug, (bound or 0) * debug, 0, 0, 0, 0, 0, 0, 0]
        agreement.agree(name, context, "expert", _FIELDS, header, env.timeout,
                        once=not every)
    return expert_layout(topk_idx, num_experts, context.group, mode=mode, bound=bound, topk_weights=topk_weights,
                         name=name)


def _check_router_weights(name: str, topk_weights: object, shape: torch.Size, device: torch.device) -> None:
    if not isinstance(topk_weights, torch.Tensor):
        raise TypeError(f"{name}: topk_weights must be a torch.Tensor [T, k], got {type(topk_weights).__name__}")
    if tuple(topk_weights.shape) != tuple(shape) or not topk_weights.is_floating_point():
        raise ValueError(f"{name}: topk_weights must be a floating tensor of topk_idx's shape [T, k] = "
                         f"{list(shape)}, got {topk_weights.dtype} of shape {list(topk_weights.shape)}")
    if topk_weights.device != device:
        raise ValueError(f"{name}: topk_weights is on {topk_weights.device} but the tokens are on {device}")


def resolved_path(name: str, device: torch.device, dtype: torch.dtype, group: dist.ProcessGroup | None,
                  path: str = "auto") -> str:
    """The path an expert call on ``device`` in ``dtype`` takes for ``path`` (the error where it cannot apply);
    collective where the P2P verdict must be asked (its first ask on the group)."""
    context = group_context(name, group, device)
    return _expert_path(name, path, context, dtype, settings.current().nccl_p2p_disabled)


def _expert_path(name: str, path: str, context: GroupContext, dtype: torch.dtype, nccl_p2p_disabled: bool) -> str:
    """The path rule's answer for an expert call on ``context``'s group and device (the error where ``path`` cannot
    apply); the expert communicators the runtime's table holds are the ones a rule may pick."""
    request = policy.ExpertRequest(context.device, dtype, context.world_size,
                                   frozenset(p for kind, p in COMMUNICATORS if kind == "expert"),
                                   context.p2p_reason, nccl_p2p_disabled, context.backend)
    chosen, why = policy.expert_path(name, path, request)
    if path == "auto" and context.device.type == "cuda":  # as the tensor-parallel ops' choice (CPU tensors: no log)
        plans.log_auto_choice(context, "the expert ops", chosen, why)
    return chosen


# -- a call ----------------------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class ExpertSpec:
    """One expert call (``op``: ``"dispatch"`` or ``"combine"``, ``comm/expert/contract.py``). dispatch: ``a [T, H]``
    (``per_choice``: ``[T*k, H]``), ``b [L, H, N]``. combine: ``a [R, K]`` in the layout's receive rows, ``b [L, K,
    H]``, ``topk_weights [T, k]`` where ``weighted``, ``out``: a preallocated ``[T, H]`` result in a's dtype (or
    None). ``return_gathered``: also return the extra rows (dispatch: received, combine: returned to the origin)."""

    name: str
    op: str
    a: torch.Tensor
    b: torch.Tensor
    layout: Layout
    group: dist.ProcessGroup | None = None
    path: str = "auto"
    topk_weights: torch.Tensor | None = None
    per_choice: bool = False
    weighted: bool = True
    return_gathered: bool = False
    hook: Hook | None = None
    out: torch.Tensor | None = None
    scales: ExpertScales | None = None  # fp8: ``a`` and ``b`` fp8, their scales (comm/expert/scaled.py)


class ExpertKind:
    """The expert ops' strategy (``calls.Kind``): communicators of kind ``"expert"``, ``ExpertPlan`` plans."""

    def agree(self, spec: ExpertSpec, timeout: float | None, once: bool = False) -> None:
        if guards.capturing() or spec.path not in policy.EXPERT_PATHS:
            return
        # Before anything collective of the call (a first call's path rule may ask the P2P verdict).
        _check_operands(spec)
        a, b, routing = spec.a, spec.b, spec.layout
        k, n = b.shape[1], b.shape[2]
        hidden, width = (k, n) if spec.op == "dispatch" else (n, k)  # width: 2F for a gate-and-up dispatch
        header = [1 + ("dispatch", "combine").index(spec.op), routing.experts, hidden, width, routing.top_k,
                  MODES.index(routing.mode), routing.bound or 0, DTYPE_CODES[rows_dtype(a, spec.scales)],
                  policy.EXPERT_PATHS.index(spec.path), int(spec.per_choice), int(spec.weighted),
                  0 if spec.scales is None else 1 + SCALED_MODES.index(spec.scales.mode),
                  0 if spec.scales is None else DTYPE_CODES[spec.scales.out_dtype],
                  # The weights' L, which only _resolve checks against the layout (after this exchange): a rank whose
                  # L is wrong where its peers' is right would raise alone there while they enter the all-to-all.
                  b.shape[0]]
        context = group_context(spec.name, spec.group, a.device)
        if routing.world_size != context.world_size:
            return  # a layout of another group: resolve raises the clear error
        counts = torch.cat([routing.send_counts.reshape(-1), routing.recv_counts.reshape(-1)])
        tails = agreement.agree(spec.name, context, "expert", _FIELDS, header, timeout, counts, once=once)
        if tails is not None:  # None: the group agreed on this call before (``once``)
            _check_counts(spec.name, context, routing, tails)

    def signature(self, spec: ExpertSpec, env: settings.Settings) -> tuple:
        _check_operands(spec)  # on every call: the layout and the weights change from call to call
        a, b, routing, group = spec.a, spec.b, spec.layout, spec.group
        return ("expert", spec.op, spec.name, a.dtype, a.device, tuple(b.shape), routing.world_size, routing.tokens,
                routing.top_k, routing.experts, routing.mode, routing.bound, spec.path, spec.per_choice,
                spec.weighted, resolved_group(group), env.nccl_p2p_disabled,
                None if spec.scales is None else spec.scales.signature())

    def lane_key(self, spec: ExpertSpec, env: settings.Settings) -> tuple | None:
        """A bounded-mode call's replay-lane key (``calls.Kind.lane_key``): its signature's every part and where each
        tensor it reads lies and how (the rows, the weights, the layout's tensors, the router weights, a preallocated
        ``out``, fp8's scales), so that a call of the key passes the checks the first one passed (they read nothing
        else) and reads the same memory. None in exact mode (its calls are issued eagerly: split sizes from the host),
        for a hook, or where an argument is not a plain tensor or layout (the checks name it)."""
        a, b, routing, weights, out, scales = spec.a, spec.b, spec.layout, spec.topk_weights, spec.out, spec.scales
        if (spec.hook is not None or type(routing) is not Layout or routing.mode != "bounded"
                or type(a) is not torch.Tensor or type(b) is not torch.Tensor
                or weights is not None and type(weights) is not torch.Tensor
                or out is not None and type(out) is not torch.Tensor):
            return None
        fp8 = None
        if scales is not None:
            if type(scales.b) is not torch.Tensor or scales.a is not None and type(scales.a) is not torch.Tensor:
                return None
            fp8 = (scales.signature(), None if scales.a is None else calls.laid_out(scales.a), calls.laid_out(scales.b))
        return ("expert", spec.op, spec.name, calls.laid_out(a), calls.laid_out(b),
                tuple([calls.laid_out(t) for t in routing.tensors()]), routing.bound, routing.top_k, routing.tokens,
                routing.experts, None if weights is None else calls.laid_out(weights),
                None if out is None else calls.laid_out(out), resolved_group(spec.group), spec.path, spec.per_choice,
                spec.weighted, spec.return_gathered, env.nccl_p2p_disabled, fp8)

    def resolve(self, spec: ExpertSpec, env: settings.Settings) -> calls.Entry:
        context, path, plan = _resolve(spec, env.nccl_p2p_disabled)
        return context.communicator("expert", path), plan, False

    def call(self, spec: ExpertSpec, entry: calls.Entry, env: settings.Settings) -> ExpertCall:
        routing, plan = spec.layout, entry[1]
        rows = routing.rows_per_expert  # exact mode: this layout's counts, on the host at no cost
        if plan.gemm is not None and rows is not None:
            gemm, hybrid = _gemm_for_rows(rows, spec.b.shape[1], spec.b.shape[2], rows_dtype(spec.a, spec.scales),
                                          spec.a.device, plan.world_size, _scaling(spec))
            if gemm != plan.gemm:
                plan = dataclasses.replace(plan, gemm=gemm, hybrid=hybrid)
        if spec.op == "combine" and spec.weighted:
            routing = routing.with_weights(spec.topk_weights)
        capturing = guards.capturing()
        return ExpertCall(spec.name, plan, spec.a, spec.b, spec.return_gathered, spec.hook,
                          None if capturing else env.timeout, env.replay and not capturing, spec.scales,
                          layout=routing, out=spec.out)


EXPERT = ExpertKind()


def _resolve(spec: ExpertSpec, nccl_p2p_disabled: bool) -> tuple[GroupContext, str, ExpertPlan]:
    """A first call's work: the group context, the path and the plan."""
    name, a, b, routing = spec.name, spec.a, spec.b, spec.layout
    context = group_context(name, spec.group, a.device)
    if routing.world_size != context.world_size:
        raise ValueError(f"{name}: layout was built for {routing.world_size} ranks but the group has "
                         f"{context.world_size}; build it with the same group")
    local = b.shape[0]
    if local * context.world_size != routing.experts:
        raise ValueError(f"{name}: the weights hold {local} local experts ([L, K, N] = {list(b.shape)}) but the "
                         f"layout routes to {routing.experts} experts over {context.world_size} ranks "
                         f"({routing.experts // context.world_size} per rank)")
    # fp8: the path rules see the output dtype (the rows move as bytes; the GEMMs are the fp8 ones).
    resolved = _expert_path(name, spec.path, context, a.dtype if spec.scales is None else spec.scales.out_dtype,
                            nccl_p2p_disabled)
    k, n = b.shape[1], b.shape[2]
    hidden, ffn = (k, n) if spec.op == "dispatch" else (n, k)
    gemm = None  # the reference path always loops
    if resolved != "reference":
        capability = torch.cuda.get_device_capability(a.device) if a.device.type == "cuda" else None
        gemm = choose_gemm(routing.mode, local, routing.tokens * routing.top_k, k, n, rows_dtype(a, spec.scales),
                           capability, chunks=context.world_size, scaling=_scaling(spec))
    plan = ExpertPlan(spec.op, context.world_size, routing.experts, hidden, ffn, routing.top_k, routing.tokens,
                      routing.mode, routing.bound, gemm, spec.per_choice, spec.weighted,
                      grouped.HYBRID_CUT if gemm == "hybrid" else None)
    return context, resolved, plan


def choose_gemm(mode: str, local: int, rows: int, k: int, n: int, dtype: torch.dtype,
                capability: tuple[int, int] | None, chunks: int = 2, scaling: str | None = None) -> str:
    """The grouped GEMM a fast path's plan runs (``ExpertPlan.gemm``) for ``local`` experts and ``rows`` rows
    (``T * k``, taken as balanced: no routing is known yet) in ``chunks`` calls (the group's size): the policy's
    (``tune.grouped.expert_gemm``; fp8, ``scaling`` ``"row"`` or ``"block"``: ``tune.grouped_fp8.expert_gemm_fp8``);
    ``"hybrid"`` plans take ``tune.grouped.HYBRID_CUT``."""
    call = grouped.GroupedCall.balanced(local, rows, k, n, dtype.itemsize, chunks)
    if scaling is not None:
        return grouped_fp8.expert_gemm_fp8(call, scaling, mode=mode, device_capability=capability,
                                           triton=_triton_available())[0]
    return grouped.expert_gemm(call, dtype, mode=mode, device_capability=capability, triton=_triton_available())[0]


@functools.lru_cache(maxsize=1024)
def _gemm_for_rows(rows: tuple[int, ...], k: int, n: int, dtype: torch.dtype, device: torch.device,
                   chunks: int, scaling: str | None = None) -> tuple[str, object]:
    """The grouped GEMM for an exact-mode layout's received rows per local expert (``Layout.rows_per_expert``):
    the cost model given the routing's counts (``tune.grouped.expert_gemm``), which the balanced guess of the
    plan's first call cannot see (skewed routing, where a per-expert loop can win)."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    call = grouped.GroupedCall(rows, k, n, dtype.itemsize, chunks)
    if scaling is not None:
        return grouped_fp8.expert_gemm_fp8(call, scaling, mode="exact", device_capability=capability,
                                           triton=_triton_available())
    return grouped.expert_gemm(call, dtype, mode="exact", device_capability=capability, triton=_triton_available())


def _scaling(spec: ExpertSpec) -> str | None:
    return None if spec.scales is None else spec.scales.mode


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_operands(spec: ExpertSpec) -> None:
    """Everything local about a call, before any collective: types, dtypes, devices, every width against the
    weights and the layout, and a combine's preallocated ``out``."""
    name, op, a, b, routing, out = spec.name, spec.op, spec.a, spec.b, spec.layout, spec.out
    rows_name, w_name = ("x", "w_up") if op == "dispatch" else ("a", "w_down")
    scales = spec.scales
    for arg, t, dims in ((rows_name, a, 2), (w_name, b, 3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        check_dense(name, arg, t)
        if t.ndim != dims:
            raise ValueError(f"{name}: {arg} must be {dims}-D, got shape {list(t.shape)}")
        fp8 = scales is not None and (t is b or scales.a is not None)  # else rows the call quantises (``wired``)
        if fp8 and t.dtype is not torch.float8_e4m3fn:  # torch's grouped fp8 kernel multiplies e4m3 only
            hint = ": quantise to float8_e4m3fn, as DeepEP and torchao's MoE training do" \
                if t.dtype is torch.float8_e5m2 else ""
            raise ValueError(f"{name}: {arg} must be float8_e4m3fn in an fp8 call (scales given), got {t.dtype}{hint}")
        if not fp8 and t.dtype not in DTYPES:
            hint = f" (fp8: pass its scales, scale_{'w' if t is b else rows_name})" if t.dtype in FP8 else ""
            raise ValueError(f"{name}: {arg} must be bfloat16, float16 or float32, got {t.dtype}{hint}")
    if not isinstance(routing, Layout):
        raise TypeError(f"{name}: layout must be a flashoverlap Layout (from flashoverlap.moe_layout), got "
                        f"{type(routing).__name__}")
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if scales is not None:
        _check_scales(spec)
    elif a.dtype != b.dtype:
        raise ValueError(f"{name}: {rows_name} is {a.dtype} but {w_name} is {b.dtype}; cast one to the other")
    if a.device != b.device or routing.send_order.device != a.device:
        raise ValueError(f"{name}: {rows_name} ({a.device}), {w_name} ({b.device}) and the layout "
                         f"({routing.send_order.device}) must be on one device")
    local, k, n = b.shape
    if local < 1 or k < 1 or n < 1:
        raise ValueError(f"{name}: {w_name} must be [L, K, N] with every dimension >= 1, got {list(b.shape)}")
    if op == "dispatch":
        want = routing.tokens * routing.top_k if spec.per_choice else routing.tokens
        if a.shape[0] != want:
            what = "T * k rows (one per choice)" if spec.per_choice else "T rows (one per token)"
            raise ValueError(f"{name}: x has {a.shape[0]} rows but the layout routes {routing.tokens} tokens: "
                             f"x must have {what} = {want}")
        if a.shape[1] != k:
            raise ValueError(f"{name}: x has hidden size {a.shape[1]} ([T, H] = {list(a.shape)}) but w_up is "
                             f"[L, H, N] = {list(b.shape)}: H must agree (pass w.transpose(1, 2) for [L, N, H] "
                             "weights)")
        if out is not None:
            raise ValueError(f"{name}: out applies to a combine only")
        return
    if a.shape[0] != routing.recv_rows:
        raise ValueError(f"{name}: a has {a.shape[0]} rows but the layout delivers {routing.recv_rows} to this "
                         "rank: pass the dispatch's output rows (same layout), activated")
    if a.shape[1] != k:
        raise ValueError(f"{name}: a has {a.shape[1]} features ([R, F] = {list(a.shape)}) but w_down is "
                         f"[L, F, H] = {list(b.shape)}: F must agree (pass w.transpose(1, 2) for [L, H, F] weights)")
    if spec.weighted:
        if spec.topk_weights is None:
            raise ValueError(f"{name}: topk_weights [T, k] is required")
        _check_router_weights(name, spec.topk_weights, torch.Size((routing.tokens, routing.top_k)), a.device)
    if out is not None:
        check_out(name, out, (routing.tokens, n), a.dtype if scales is None else scales.out_dtype, a.device)


def _check_scales(spec: ExpertSpec) -> None:
    """An fp8 call's scales against its operands (``comm/expert/scaled.py``'s table), naming the argument. On every
    call, so without building what a passing check does not need."""
    name, scales, a, b = spec.name, spec.scales, spec.a, spec.b
    mode, out_dtype = scales.mode, scales.out_dtype
    if mode != "row" and mode != "block":
        raise ValueError(f"{name}: fp8 scaling must be 'row' or 'block', got {mode!r}")
    if out_dtype is not torch.bfloat16 and out_dtype is not torch.float32:
        raise ValueError(f"{name}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    local, k, n = b.shape
    if mode == "block":
        if k % 128:
            raise ValueError(f"{name}: block-wise scales need K = {k} (the rows' width) to be a multiple of 128")
        _check_scale(name, "scale_w", scales.b, (local, k // 128, -(-n // 128)), a.device, mode,
                     "[L, K/128, ceil(N/128)] (one per 128x128 block of w[l] [K, N])")
    else:
        _check_scale(name, "scale_w", scales.b, (local, n), a.device, mode, "[L, N] (one per expert and output column)")
    if scales.a is not None:  # else the rows are quantised by the call
        _check_scale(name, "scale_x" if spec.op == "dispatch" else "scale_a", scales.a,
                     (a.shape[0], k // 128 if mode == "block" else 1), a.device, mode,
                     ("[rows, K/128]" if mode == "block" else "[rows, 1]") + ", the mode scale_w's shape says: the "
                     "rows' scales and the weights' share one mode")


def _check_scale(name: str, arg: str, t: object, want: tuple, device: torch.device, mode: str, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(name, arg, t)
    if t.dtype is not torch.float32 or t.shape != want or t.device != device:
        raise ValueError(f"{name}: {arg} must be float32 {list(want)} on {device} ({mode}-wise: {what}), got "
                         f"{t.dtype} {list(t.shape)} on {t.device}")


# -- the agreement check: the ranks agree ------------------------------------------------------------------------
_FIELDS = (("op", ("moe_layout", "dispatch", "combine")), "num_experts", "hidden size H",
           "expert weights' width (dispatch's N, combine's K)", "top-k",
           ("mode", MODES), "bound", ("dtype", DTYPE_NAMES), ("path", policy.EXPERT_PATHS),
           ("per_choice", ("False", "True")), ("weighted", ("False", "True")),
           ("fp8 scaling", ("none", "row", "block")), ("out_dtype", DTYPE_NAMES),
           "local experts (the weights' L)")


def _check_counts(name: str, context: GroupContext, routing: Layout, rows: list[list[int]]) -> None:
    """What each rank sends each other rank is what that rank's layout expects to receive (``rows``: every rank's
    send counts then receive counts); else every rank raises, naming the ranks."""
    world = context.world_size
    pairs = routing.send_counts.numel()
    sends = [row[:pairs] for row in rows]  # [source][destination * L + l]
    receives = [row[pairs:] for row in rows]  # [destination][source * L + l]
    local_experts = pairs // world
    bad = [(s, d) for s in range(world) for d in range(world)
           if sends[s][d * local_experts : (d + 1) * local_experts]
           != receives[d][s * local_experts : (s + 1) * local_experts]]
    if bad:
        described = ", ".join(f"rank {s} sends rank {d} other counts than rank {d} expects" for s, d in bad[:8])
        raise ValueError(f"{name}: rank {context.rank} of {context.name}: the ranks' layouts disagree ({described}): "
                         "build the layout once per layer on every rank (moe_layout) and pass the same one to the "
                         "layer's dispatch and combine")
    if routing.mode == "exact":
        splits = [sum(sends[context.rank][d * local_experts : (d + 1) * local_experts]) for d in range(world)]
        if list(routing.send_splits) != splits:
            raise ValueError(f"{name}: rank {context.rank}: the layout's send_splits {list(routing.send_splits)} "
                             f"disagree with its counts {splits}")
