"""Thin wrappers over ``torch.distributed`` collectives that differ between the torch versions we support, the
blocking collectives of the sequential plan issued straight to the process group, and the one layout helper the
all-gather paths share."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.overrides import has_torch_function

from flashoverlap.plan import Plan

# torch >= 2.13 deprecates the *_tensor names for *_single, which torch 2.11 (the GPU machines') does not have.
# Chosen once: a ``warnings.catch_warnings`` around every call would cost host time on every op call.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``dist.reduce_scatter_tensor`` (or its torch >= 2.13 name)."""
    _reduce_scatter(out, inp, group=group)


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                           async_op: bool = False):
    """``dist.all_gather_into_tensor`` (or its torch >= 2.13 name); its work handle where ``async_op``. CUDA tensors
    over a group of another backend than NCCL (ranks sharing one GPU over gloo: the expert layout's counts) go
    through host memory, blocking."""
    if inp.is_cuda and not async_op and dist.get_backend(group) != "nccl":
        staged = out.new_empty(out.shape, device="cpu")
        _all_gather(staged, inp.cpu(), group=group)
        out.copy_(staged)
        return None
    return _all_gather(out, inp, group=group, async_op=async_op)


def _blocking_options(name: str) -> object | None:
    """An options object of ``torch.distributed``'s kind ``name``, filled as its blocking collectives fill it (sum;
    ``asyncOp`` off where this torch has it: NCCL then runs the collective on the caller's stream); None where this
    torch lacks the kind."""
    kind = getattr(c10d, name, None)
    if kind is None:
        return None
    options = kind()
    if hasattr(options, "reduceOp"):
        options.reduceOp = dist.ReduceOp.SUM
    if hasattr(options, "asyncOp"):
        options.asyncOp = False
    return options


# The process-group methods behind torch's blocking collectives and their options, chosen once (torch >= 2.13
# renamed two methods): any of them missing, every call goes through ``torch.distributed``. And the coalescing
# manager's state (``dist._coalescing_manager``: the groups whose collectives it defers; torch empties this dict,
# never replaces it), which ``refuse_coalescing`` reads.
_REDUCE_SCATTER_METHOD = next((name for name in ("reduce_scatter_single", "_reduce_scatter_base")
                               if hasattr(dist.ProcessGroup, name)), None)
_ALL_GATHER_METHOD = next((name for name in ("all_gather_single", "_allgather_base")
                           if hasattr(dist.ProcessGroup, name)), None)
_OPTIONS = (_blocking_options("AllreduceOptions"), _blocking_options("ReduceScatterOptions"),
            _blocking_options("AllgatherOptions"))
_COALESCING = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
if not isinstance(_COALESCING, dict):  # this torch keeps it elsewhere: nothing to check (issued calls are not deferred)
    _COALESCING = {}
_COALESCED_ALL_GATHER = getattr(dist.ProcessGroup, "allgather_into_tensor_coalesced", None)
_DIRECT = None not in _OPTIONS and _REDUCE_SCATTER_METHOD is not None and _ALL_GATHER_METHOD is not None


def refuse_coalescing(group: dist.ProcessGroup, what: str) -> None:
    """Raise where ``group`` is inside ``dist._coalescing_manager``: it defers the group's collectives to its exit,
    so ``what`` (a call that uses a collective's result at once, as all-gather's GEMM does) would compute on data
    that has not arrived."""
    if _COALESCING and group in _COALESCING:
        raise RuntimeError(f"{what}: called inside torch.distributed's coalescing manager on its group, which defers "
                           "the collective the call needs now; call it outside the `with` block")


def _through_torch(tensor: torch.Tensor) -> bool:
    """Whether a blocking collective on ``tensor`` must go through ``torch.distributed``'s function: a
    ``__torch_function__`` mode or subclass may take it over. (``torch.set_default_device`` and ``with
    torch.device(...)`` install such a mode: every call then goes through torch, correct, without the saving.)"""
    return not _DIRECT or has_torch_function((tensor,))


def all_reduce_now(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``dist.all_reduce(tensor, group=group)`` (sum, blocking), issued straight to ``group``'s backend with the
    options torch's function would build: its Python checks (the tensor's type, the group's membership, complex
    views) are the runtime's, made once per call signature, and cost host time on every call of the sequential
    plan (the decode case). ``group``: a process group this rank belongs to, not inside a coalescing manager
    (``refuse_coalescing``); ``tensor``: real, dense."""
    if _through_torch(tensor):
        dist.all_reduce(tensor, group=group)
        return
    work = group.allreduce([tensor], _OPTIONS[0])
    if work is not None:  # as torch's function: a backend may have synchronised already
        work.wait()


def reduce_scatter_now(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``dist.reduce_scatter_tensor(out, inp, group=group)`` (sum, blocking), issued straight to ``group``'s
    backend (as ``all_reduce_now``)."""
    _base_now(_REDUCE_SCATTER_METHOD, _OPTIONS[1], reduce_scatter_tensor, out, inp, group)


def all_gather_now(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``dist.all_gather_into_tensor(out, inp, group=group)`` (blocking), issued straight to ``group``'s backend
    (as ``all_reduce_now``)."""
    _base_now(_ALL_GATHER_METHOD, _OPTIONS[2], all_gather_into_tensor, out, inp, group)


def all_gather_pair_now(outs: tuple[torch.Tensor, torch.Tensor], ins: tuple[torch.Tensor, torch.Tensor],
                        group: dist.ProcessGroup) -> None:
    """Two blocking all-gathers (``ins[i]`` into ``outs[i]``, contiguous tensors) in one collective call, the group's
    ``allgather_into_tensor_coalesced`` (NCCL: one group launch), on byte views (gloo's coalesced all-gather mixed
    up tensors of different dtypes); one ``all_gather_now`` each where this torch lacks the method or a
    ``__torch_function__`` mode must see the calls. The fp8 sequential all-gather's rows and their scales: a shard's
    scales travel in the same call as its rows."""
    if _COALESCED_ALL_GATHER is None or _through_torch(ins[0]) or _through_torch(ins[1]):
        for out, inp in zip(outs, ins):
            all_gather_now(out, inp, group)
        return
    work = group.allgather_into_tensor_coalesced([t.view(torch.uint8) for t in outs],
                                                 [t.view(torch.uint8) for t in ins], _OPTIONS[2])
    if work is not None:
        work.wait()


def _base_now(method: str | None, options: object, through_torch: Callable, out: torch.Tensor, inp: torch.Tensor,
              group: dist.ProcessGroup) -> None:
    """One blocking collective from ``inp`` into ``out`` by the process-group ``method``, or by ``through_torch``
    (torch's function) where ``_through_torch`` says so."""
    if _through_torch(inp):
        through_torch(out, inp, group)
        return
    work = getattr(group, method)(out, inp, options)
    if work is not None:
        work.wait()


def even_band_rows(plan: Plan, gathered_rows: int) -> int | None:
    """The rows of every group where all of an all-gather plan's groups have the same (the usual plan), its bands
    following each other in group order in a buffer of ``gathered_rows`` rows, each W slots of that many rows
    (``Plan.groups``); else None."""
    groups = plan.groups
    rows = groups[0].rows
    if (all(g.rows == rows for g in groups) and rows * len(groups) == plan.block_rows
            and groups[-1].out_row_end == gathered_rows):
        return rows
    return None


def own_slots(gathered: torch.Tensor, plan: Plan, rank: int) -> torch.Tensor | None:
    """``rank``'s slot of every band of ``gathered`` (the plan's ``[group][W][rows][K]`` layout) as one ``[G, rows,
    K]`` view, where every group has the same rows (``even_band_rows``); else None."""
    rows = even_band_rows(plan, gathered.shape[0])
    return None if rows is None else gathered.view(len(plan.groups), plan.world_size, rows, -1)[:, rank]


def place_own_shard(gathered: torch.Tensor, a_shard: torch.Tensor, plan: Plan, rank: int) -> None:
    """Copy ``rank``'s shard into its slot of every band of ``gathered`` (the plan's ``[group][W][rows][K]``
    layout) on the current stream, so that the GEMM's local tiles read it without waiting: one strided copy where
    every group has the same rows (``own_slots``), else one copy per group."""
    slots = own_slots(gathered, plan, rank)
    if slots is not None and a_shard.shape[0] == plan.block_rows:
        slots.copy_(a_shard.view(slots.shape[0], slots.shape[1], -1))
        return
    for grp in plan.groups:
        start = grp.out_row_start + rank * grp.rows
        gathered[start : start + grp.rows].copy_(a_shard[grp.row_start : grp.row_end])


def gathered_in_rank_order(gathered: torch.Tensor, plan: Plan, out: torch.Tensor | None = None) -> torch.Tensor:
    """The gathered A as ``all_gather_into_tensor`` of whole shards returns it (rank order), from the plan's
    ``[group][W][rows][K]`` layout (into ``out``, of ``gathered``'s shape and dtype, where given)."""
    world_size, shard_rows = plan.world_size, plan.block_rows
    full = torch.empty_like(gathered) if out is None else out
    for grp in plan.groups:
        band = gathered[grp.out_row_start : grp.out_row_end]
        full.view(world_size, shard_rows, -1)[:, grp.row_start : grp.row_end].copy_(
            band.view(world_size, grp.rows, -1))
    return full
