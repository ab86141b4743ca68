"""The contract of an expert-parallel (MoE) call: what the all-to-all communicators are given, as plain values.

This module owns the description of one dispatch or combine call (``ExpertPlan``: shapes, mode, bound, the
grouped-GEMM choice; dtype-free, hashable), the per-call routing (``Layout``: device tensors built once per layer
by ``expert_layout``, shared by the layer's dispatch and combine and by their backward calls), the call a
communicator's ``run(call)`` receives (``ExpertCall``). Beside it: ``layout.py`` builds the layout,
``rows.py`` holds the row mechanics every path shares (``send_buffer``, ``source_rows``, ``recv_segments``,
``combine_at_origin``). Communicators (``reference.py``, ``nccl.py``, ``p2p.py`` here) implement
``run(ExpertCall)``; the runtime (``runtime/experts.py``) checks operands, resolves the path and builds the plan
before any of them runs.

Shape algebra, for a group of ``W`` ranks, this rank ``r``, ``E`` experts of which ``L = E / W`` are local (expert
``e`` lives on rank ``e // L`` as local expert ``e % L``), ``T`` tokens on this rank, top-``k`` routing:

- ``x_r: [T, H]`` this rank's tokens; ``topk_idx_r: [T, k]`` int (global expert indices in ``[0, E)``);
  ``topk_weights_r: [T, k]`` float (router weights).
- choices: the ``T * k`` (token, choice) pairs, numbered ``j = t * k + c`` (``topk_idx_r.flatten()`` order).
- send order: the choices sorted (stably) by expert, hence by (destination rank, local expert):
  ``send_order_r: [T*k]``, ``send_order_r[i] = j``. ``send_counts_r: [W, L]``: choices this rank sends to
  (rank d, local expert l). ``recv_counts_r: [W, L]``: rows rank s sends to this rank's local expert l
  (``recv_counts_r[s, l] == send_counts_s[r, l]``; one all-gather of the counts).
- send buffer ``[S_r, H]``: the rows leaving this rank, grouped by destination, by local expert inside. Row
  ``send_rows_r[i]`` holds choice ``send_order_r[i]``'s row (``x_r[j // k]``).
- receive buffer ``[R_r, H]``: the rows arriving here, grouped by (source rank, local expert), sources in rank
  order. Segment ``(s, l)`` (index ``s * L + l``) is rows ``[recv_seg_starts[s*L + l], recv_seg_ends[s*L + l])``.
- weights: ``w_up_r: [L, H, 2F]`` (gate and up fused: columns ``[:F]`` gate, ``[F:]`` up), ``w_down_r: [L, F, H]``;
  any strides (``w.transpose(1, 2)`` of ``nn.Linear``-shaped ``[L, N, K]`` weights is read in place).

Two modes (``ExpertPlan.mode``):

- ``"exact"``: rows are packed. ``S_r = T * k`` (``send_rows_r[i] == i``), ``R_r = sum(recv_counts_r)``.
  ``expert_layout`` exchanges the counts and synchronises with the host once, so that the layout also carries the
  host split sizes ``send_splits`` / ``recv_splits`` (rows per peer) that ``all_to_all_single`` takes.
- ``"bounded"``: every (source, destination) pair moves at most ``bound`` rows, in fixed slots, so that no shape
  depends on the routing and nothing synchronises with the host (capturable in a CUDA graph, traceable with
  ``torch.compile(fullgraph=True)``). ``S_r = R_r = W * bound``: the rows for destination d are
  ``[d * bound, d * bound + sum(send_counts_r[d]))``; the rows from source s are
  ``[s * bound, s * bound + sum(recv_counts_r[s]))``. Rows between and after are padding. Dropless: a source
  whose rows for one destination exceed ``bound`` (or an expert index outside ``[0, E)``) is an error that names
  the bound and the ranks, raised by every rank once the counts are exchanged, before any token row moves: a Python
  error on the CPU, ``torch._assert_async`` on CUDA (no synchronisation; the CUDA context is lost, as with any
  device-side assertion). Never a dropped token.

What the calls compute (``ExpertCall``; ``K, N`` are the per-expert GEMM's, ``ExpertPlan.gemm_shape``):

- dispatch: ``a: [T, H]`` (``per_choice``: ``[T*k, H]``, one row per choice: combine's backward), ``b: [L, H, N]``
  -> ``h_r: [R_r, N]``, ``h_r[seg (s, l)] = recv_rows[seg (s, l)] @ b[l]`` (fp32 accumulation, rounded to a's
  dtype); with ``return_gathered`` also ``recv_rows_r: [R_r, H]``, the rows received. Plain equivalent: gather the
  rows in send order, ``all_to_all_single`` with the split sizes, a GEMM per local expert.
- combine: ``a: [R_r, K]`` (dispatch's layout), ``b: [L, K, H]`` -> ``out_r: [T, H]``, ``out_r[t] = sum_c
  w[t, c] * y[t, c]`` where ``y[t, c]`` is choice ``(t, c)``'s row of ``a @ b[l]`` returned to its origin by the
  reverse all-to-all, ``w`` the router weights (``layout.weights``; ``weighted=False``: weight 1, the sum that
  dispatch's backward needs); the weighted sum in fp32, rounded to a's dtype. With ``return_gathered`` also
  ``y_back_r: [S_r, H]``, the unweighted rows as they came back, in the send layout (router weights' gradient).
- Padding rows (bounded mode) and rows no segment covers are zero in every output; the rows of a token with no
  choices never occur (every token has k choices).

For the fast paths: the per-expert GEMM runs on the receive buffer's segments (``recv_segments``: starts, ends,
local expert; int32, on the device, never on the host in bounded mode). In bounded mode the segments leave gaps
(each source's slot is ``bound`` rows), which ``kernels.grouped_gemm`` (segment ends only: a segment starts where
the previous one ends) would compute as part of the next segment; a fast path covers each gap with a segment of
its own (any expert, signal group out of range) until the kernel takes segment starts. Outputs must still be
zero there (zero the buffer, or the gap rows, first).

Autograd (``ops/moe.py``) composes these: dispatch's backward is a combine (``b^T``, unweighted) and combine's
backward a per-choice dispatch (``b^T`` of the router-weighted output gradient), plus per-expert weight gradients
on the received rows and ``grad_w[t, c] = <grad_out[t], y_back[t, c]>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flashoverlap.comm.expert.scaled import wire_width
from flashoverlap.comm.protocol import Call, held_signature
from flashoverlap.comm.replay import address, signature

OPS = ("dispatch", "combine")
MODES = ("exact", "bounded")
GEMMS = ("triton", "cublas", "loop", "hybrid")
HOST_SIZED_GEMMS = ("loop", "hybrid")  # they read the segment sizes on the host: exact mode only


@dataclass(frozen=True)
class HybridCut:
    """Where the hybrid grouped GEMM (``ExpertPlan.gemm == "hybrid"``) cuts a layout, as the policy
    (``tune/grouped.py``) chose: an expert whose rows, summed over the sources, reach ``heavy_rows`` is heavy (a
    ``torch.mm`` per segment, chunk by chunk); the others run in one row-mapped Triton launch, with the flattened
    persistent tile where they average at least ``light_flat_rows`` rows (``comm/expert/chunked_gemm.py``)."""

    heavy_rows: int
    light_flat_rows: int

    def __post_init__(self) -> None:
        for name in ("heavy_rows", "light_flat_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"HybridCut: {name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ExpertPlan:
    """One expert call as plain values (no dtype, no device, no tensors), validated on construction.

    ``op``: ``"dispatch"`` (all-to-all, then the GEMM) or ``"combine"`` (GEMM, then the reverse all-to-all and the
    weighted sum). ``world_size`` ranks; ``experts`` in all (``experts_per_rank = experts / world_size`` on each).
    ``hidden``: the width of the rows that move (the token side: ``H`` forward); ``ffn``: the expert side of the
    GEMM (dispatch's ``N``, combine's ``K``: ``2F`` and ``F`` forward; in dispatch's backward, a combine,
    ``ffn = 2F``; in combine's backward, a dispatch, ``ffn = F``). ``top_k`` choices per token, ``tokens`` (``T``)
    on this rank. ``mode``: ``"exact"`` (``bound`` None) or ``"bounded"`` (``bound`` >= 1 rows per (source,
    destination) pair, the same on every rank). ``gemm``: the grouped GEMM the fast paths run (``"triton"``:
    ``kernels.grouped_gemm``, ``"cublas"``: ``torch._grouped_mm``, ``"loop"``: ``torch.mm`` per segment, exact
    mode only: it needs the segment sizes on the host, which bounded mode never reads; ``"hybrid"``, exact mode
    only: ``torch.mm`` per segment for the heavy experts, chunk by chunk, and one row-mapped Triton launch over every
    source's rows of the light ones, ``comm/expert/chunked_gemm.py``'s ``light_multiplier``, cut where ``hybrid`` (a
    ``HybridCut``, given with ``"hybrid"`` and only then) says; None: the runtime's choice,
    ``runtime/experts.py``, which a plan built elsewhere leaves to ``chunked_gemm.chunk_gemm``: the loop in exact
    mode, Triton in bounded mode; the reference path always loops and keeps None). ``per_choice`` (dispatch): the
    rows given are one per choice ``[T*k, H]`` instead of one per token. ``weighted`` (combine): sum the returned
    rows with the router weights (else with 1).
    """

    op: str
    world_size: int
    experts: int
    hidden: int
    ffn: int
    top_k: int
    tokens: int
    mode: str = "exact"
    bound: int | None = None
    gemm: str | None = None
    per_choice: bool = False
    weighted: bool = True
    hybrid: HybridCut | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"ExpertPlan: op must be one of {OPS}, got {self.op!r}")
        if self.mode not in MODES:
            raise ValueError(f"ExpertPlan: mode must be one of {MODES}, got {self.mode!r}")
        if self.gemm is not None and self.gemm not in GEMMS:
            raise ValueError(f"ExpertPlan: gemm must be one of {GEMMS} or None (the runtime chooses), got "
                             f"{self.gemm!r}")
        if self.gemm in HOST_SIZED_GEMMS and self.mode == "bounded":
            raise ValueError(f"ExpertPlan: gemm={self.gemm!r} cannot run with mode='bounded': it needs the segment "
                             "sizes on the host, which bounded mode never reads; pass gemm='triton' or 'cublas' (or "
                             "None: the runtime chooses), or mode='exact'")
        if (self.gemm == "hybrid") != isinstance(self.hybrid, HybridCut):
            raise ValueError(f"ExpertPlan: gemm='hybrid' takes its cut (hybrid=HybridCut(heavy_rows, light_flat_rows)) "
                             f"and no other gemm takes one; got gemm={self.gemm!r}, hybrid={self.hybrid!r}")
        for name in ("world_size", "experts", "hidden", "ffn", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ExpertPlan: {name} must be an int >= 1, got {value!r}")
        if not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"ExpertPlan: tokens must be an int >= 0, got {self.tokens!r}")
        if self.experts % self.world_size:
            raise ValueError(f"ExpertPlan: {self.experts} experts cannot be shared evenly by {self.world_size} ranks")
        if self.top_k > self.experts:
            raise ValueError(f"ExpertPlan: top_k = {self.top_k} exceeds the {self.experts} experts")
        if self.mode == "exact" and self.bound is not None:
            raise ValueError(f"ExpertPlan: mode='exact' takes no bound, got bound={self.bound}")
        if self.mode == "bounded" and (not isinstance(self.bound, int) or self.bound < 1):
            raise ValueError(f"ExpertPlan: mode='bounded' needs bound >= 1 (rows per source and destination), got "
                             f"{self.bound!r}")
        if self.per_choice and self.op != "dispatch":
            raise ValueError("ExpertPlan: per_choice applies to dispatch only")
        if not self.weighted and self.op != "combine":
            raise ValueError("ExpertPlan: weighted=False applies to combine only")

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.world_size

    @property
    def gemm_shape(self) -> tuple[int, int]:
        """``(K, N)`` of each expert's GEMM: dispatch ``[rows, hidden] x [hidden, ffn]``, combine ``[rows, ffn] x
        [ffn, hidden]``."""
        return (self.hidden, self.ffn) if self.op == "dispatch" else (self.ffn, self.hidden)

    @property
    def choices(self) -> int:
        """``T * k``: the (token, choice) rows this rank sends."""
        return self.tokens * self.top_k

    @property
    def send_capacity(self) -> int:
        """``S_r``: rows of the send buffer (exact: ``T * k``; bounded: ``W * bound``)."""
        return self.choices if self.mode == "exact" else self.world_size * self.bound

    @property
    def recv_capacity(self) -> int | None:
        """``R_r`` where it is fixed (bounded: ``W * bound``); None in exact mode (``layout.recv_rows``)."""
        return None if self.mode == "exact" else self.world_size * self.bound


@dataclass(frozen=True, eq=False)  # tensors: compared and hashed by identity
class Layout:
    """One layer's routing on this rank (see the module docstring): device tensors, plus host split sizes in exact
    mode. Built by ``expert_layout``; shared by the dispatch and combine of one layer and their backward calls.

    ``send_order``: int64 ``[T*k]`` choices in send order. ``send_rows``: int64 ``[T*k]``, the send-buffer row of
    each (exact: ``arange``; bounded: its destination's slot). ``send_counts``, ``recv_counts``: int64 ``[W, L]``.
    ``recv_seg_starts``, ``recv_seg_ends``: int32 ``[W*L]``, segment ``(s, l)``'s rows in the receive buffer.
    ``weights``: router weights in send order ``[T*k]`` (their dtype), or None. ``send_splits``, ``recv_splits``:
    rows per peer (exact mode; None in bounded mode, where every split is ``bound``). ``max_pair_rows``: the most
    rows any (source, destination) pair of the group moves, the same on every rank (exact mode: read from the
    all-gathered counts in ``expert_layout``'s one host synchronisation, so that a path sizing per-pair buffers
    alike on every rank needs no collective of its own; bounded mode: ``bound``). ``recv_counts_host``: exact mode,
    ``recv_counts`` on the host (``[W][L]``), read in the same synchronisation (None where unknown: bounded mode, or
    a layout rebuilt from its tensors). ``mode``, ``bound``, ``top_k``, ``tokens``, ``experts``: the values it was
    built for."""

    send_order: torch.Tensor
    send_rows: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    recv_seg_starts: torch.Tensor
    recv_seg_ends: torch.Tensor
    mode: str
    bound: int | None
    top_k: int
    tokens: int
    experts: int
    weights: torch.Tensor | None = None
    send_splits: tuple[int, ...] | None = None
    recv_splits: tuple[int, ...] | None = None
    max_pair_rows: int | None = None
    recv_counts_host: tuple[tuple[int, ...], ...] | None = None

    @property
    def rows_per_expert(self) -> tuple[int, ...] | None:
        """Each local expert's received rows, summed over the sources, where the host knows them
        (``recv_counts_host``), else None: what the grouped-GEMM policy reads of a layout's routing."""
        if self.recv_counts_host is None:
            return None
        return tuple(sum(column) for column in zip(*self.recv_counts_host))

    @property
    def world_size(self) -> int:
        return self.send_counts.shape[0]

    @property
    def experts_per_rank(self) -> int:
        return self.send_counts.shape[1]

    @property
    def send_capacity(self) -> int:
        return self.tokens * self.top_k if self.mode == "exact" else self.world_size * self.bound

    @property
    def recv_rows(self) -> int:
        """``R_r``: rows of the receive buffer (exact: ``sum(recv_splits)``, host-known; bounded: ``W * bound``)."""
        return sum(self.recv_splits) if self.mode == "exact" else self.world_size * self.bound

    def send_ordered(self, topk_weights: torch.Tensor) -> torch.Tensor:
        """The router weights ``[T, k]`` in send order, ``[T*k]`` (one gather on the device)."""
        return topk_weights.reshape(-1).index_select(0, self.send_order)

    def with_weights(self, topk_weights: torch.Tensor | None) -> Layout:
        """This layout with the router weights ``[T, k]`` taken in send order (None: no weights)."""
        weights = None if topk_weights is None else self.send_ordered(topk_weights)
        # dataclasses.replace, without its per-field __init__ (a frozen dataclass's: microseconds, once per combine).
        layout = object.__new__(Layout)
        layout.__dict__.update(self.__dict__)
        layout.__dict__["weights"] = weights
        return layout

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors, in the order the constructor takes them first (the custom ops pass them as one list)."""
        return [self.send_order, self.send_rows, self.send_counts, self.recv_counts, self.recv_seg_starts,
                self.recv_seg_ends]



@dataclass(slots=True, eq=False)  # as Call: a value communicators never write, built without frozen's __init__
class ExpertCall(Call):
    """An expert call as a communicator's ``run`` receives it: the protocol's ``Call`` (``plan``: an
    ``ExpertPlan``; ``a``, ``b``: the rows and the stacked local weights ``[L, K, N]``; ``return_gathered``: also
    return dispatch's received rows or combine's returned rows; ``hook``, ``timeout``, ``replay`` as for every
    call) with the routing ``layout`` added (its ``weights`` set for a weighted combine), and for a combine
    ``out``, a preallocated ``[T, H]`` result in ``a``'s dtype (checked by the runtime) or None. ``run`` returns
    ``(result, extra)`` as described in the module docstring (the result is ``out`` where given)."""

    layout: Layout | None = None
    out: torch.Tensor | None = None


def call_signature(call: ExpertCall, a: torch.Tensor, outputs: tuple[torch.Tensor, torch.Tensor | None]) -> tuple:
    """What an expert call's GPU work depends on besides the tensors' values (``comm/replay.py``), in
    ``replay.signature``'s two parts: ``call_inputs``, and where the tensors made for the call lie (the router
    weights in send order, which the runtime gathers for a weighted combine, and the call's outputs), with cuBLAS's
    switches. A communicator adds its own buffers'."""
    return signature(call_inputs(call, a), (address(call.layout.weights), *[address(t) for t in outputs]))


def call_inputs(call: ExpertCall, a: torch.Tensor) -> tuple:
    """``call_signature``'s first part, fixed by the call's tensors: the plan, the dtype, where each tensor the call
    reads lies and how (the rows ``a`` as the call reads them, the weights, the layout's), an fp8 call's scales and a
    held hook's tensors."""
    layout, scales = call.layout, call.scales
    fp8 = None if scales is None else (scales.signature(), address(scales.a), address(scales.b))
    return (call.plan, a.dtype, call.return_gathered, address(a), address(call.b),
            tuple(address(t) for t in layout.tensors()), fp8, held_signature(call.hook))


def replayer(call: ExpertCall, graphs, new, own=None) -> Callable[[Any], tuple | None] | None:
    """The replay lane of bounded-mode calls that read ``call``'s tensors (``comm/protocol.py``; the runtime's key,
    ``runtime/experts.py``, holds where each of them lies, the layout's included): a function of the next such call's
    spec that makes what the call makes before its graph runs, in the same order (a weighted combine's router
    weights in send order, then the outputs, by ``new``), and replays the graph ``graphs`` holds for them
    (``own()``: the communicator's own part of the signature); None where it holds none (the runtime then runs the
    call). None where no lane applies: not replayed, exact mode, a hook, no graph held yet, a combine whose rows
    ``run`` copies (not contiguous in their last dimension). It holds no tensor of the call's."""
    plan, a = call.plan, call.a
    if (not call.replay or plan.mode != "bounded" or call.hook is not None or not graphs
            or plan.op == "combine" and a.stride(-1) != 1):
        return None
    inputs = call_inputs(call, a)
    # A weighted combine's router weights: gathered in send order for each call (``Layout.with_weights``, as the
    # runtime does); any other call reads its layout's own (None, or given to ``expert_layout``).
    gathers = plan.op == "combine" and plan.weighted
    first_shape, rows_shape = _output_shapes(call, a)
    replay = graphs.replay

    def again(spec) -> tuple | None:
        layout = spec.layout  # the gather issued where the runtime issues it for a call: before the outputs
        weights = layout.send_ordered(spec.topk_weights) if gathers else layout.weights
        first = spec.out if first_shape is None else new(*first_shape)
        extra = None if rows_shape is None else new(*rows_shape)
        made = (address(weights), address(first), address(extra))
        key = signature(inputs, made)
        if replay(key if own is None else (key, *own())):
            return first, extra
        return None

    return again


def call_outputs(call: ExpertCall, a: torch.Tensor, new) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An expert call's outputs, allocated by ``new(shape, dtype)`` (a communicator's allocator) in one order on every
    call, so that a repeated call finds them where the previous one did: dispatch ``(h [R, N], received rows [R,
    H])`` (fp8: ``h`` in the output dtype, the rows packed with their scales); combine ``(out [T, H], returned rows
    [S, H])``, ``out`` the call's own where given. The rows only where the call returns them (``return_gathered``);
    else None, and the issued work allocates them as its first step (``issued_rows``): a replayed call's graph then
    holds them, and its host allocates nothing for them."""
    first_shape, rows_shape = _output_shapes(call, a)
    first = call.out if first_shape is None else new(*first_shape)
    return first, None if rows_shape is None else new(*rows_shape)


def issued_rows(call: ExpertCall, a: torch.Tensor, outputs: tuple[torch.Tensor, torch.Tensor | None],
                new) -> torch.Tensor:
    """``outputs``' rows buffer (``call_outputs``), allocated by ``new`` where the call does not return it: dispatch's
    received rows ``[R, H]`` (fp8: packed with their scales, bytes), combine's returned rows ``[S, H]`` in the output
    dtype. Called first in a communicator's issued work (inside a capture: from the graph's pool)."""
    return outputs[1] if outputs[1] is not None else new(*_rows_shape(call, a))


def _output_shapes(call: ExpertCall, a: torch.Tensor) -> tuple[tuple | None, tuple | None]:
    """``(shape, dtype)`` of each output ``call_outputs`` allocates, in its order: the result (None: the call's own
    ``out``) and the rows buffer (None: not returned, ``issued_rows`` makes it in the issued work)."""
    plan, scales = call.plan, call.scales
    dtype = a.dtype if scales is None else scales.out_dtype
    if plan.op == "dispatch":
        first = (call.layout.recv_rows, call.b.shape[2]), dtype
    else:
        first = None if call.out is not None else ((plan.tokens, plan.hidden), dtype)
    return first, _rows_shape(call, a) if call.return_gathered else None


def _rows_shape(call: ExpertCall, a: torch.Tensor) -> tuple:
    """``(shape, dtype)`` of a call's rows buffer (``issued_rows``)."""
    plan, layout, scales = call.plan, call.layout, call.scales
    if plan.op == "dispatch":
        if scales is None:
            return (layout.recv_rows, plan.hidden), a.dtype
        return (layout.recv_rows, wire_width(plan.hidden, scales.mode)), torch.uint8
    return (layout.send_capacity, plan.hidden), a.dtype if scales is None else scales.out_dtype
