"""Path and plan policy, every rule in one place: which paths a call may take (one predicate per path that returns
why it cannot, in the spirit of PyTorch's ``_should_use_*``), which one ``path="auto"`` takes, and the plan of a call
that gives none (``decide``: path and plan in one pass, from the call's facts gathered once by ``runtime/plans.py``;
the plans themselves come from ``tune/``, which takes values).

Paths a caller names: ``"auto"``, ``"nccl"``, ``"p2p"``, ``"ring"``, ``"reference"`` (``CALL_PATHS``). A plan names
the communicator it is for (``Plan.path``); a plan marked sequential runs the matmul-then-collective communicator.

The group's backend: the P2P path moves no bytes through it (its peers' memory is mapped, the group only bootstraps
the mapping), so any group may serve it, gloo included (ranks sharing one GPU); every other path moves its bytes
through the backend (NCCL's collectives and send/recv, the reference's collectives, a sequential plan's collective),
and with CUDA tensors needs an NCCL group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashoverlap.plan import P2P_MAX_RANKS, Plan
from flashoverlap.runtime import checks
from flashoverlap.tune import fp8 as fp8_rules
from flashoverlap.tune.defaults import default_plan, sequential_plan
from flashoverlap.tune.rates import Rates

CALL_PATHS = ("auto", "nccl", "p2p", "ring", "reference")
# The overlapped paths are built and measured for half precision, and those in FP8_PATHS for fp8 too; float32 calls
# run the plain matmul and one collective (a sequential plan) on CUDA, and the reference path elsewhere; an fp8 call
# that names another overlapped path (or passes its plan) is refused (``_full_precision``, ``reason_not_ring``).
HALF_DTYPES = checks.HALF_DTYPES
# P2P in fp8: the bf16 schedule with scaled cuBLAS sub-bands (0.94-1.02x one whole ``torch._scaled_mm`` on one H200,
# h200x1-fp8-gemm.json); its mechanics checked on one GPU with two processes, eager and replayed
# (benchmarks/diagnostics/p2p_fp8_one_gpu.py, logs/issue35); its two-GPU speed is issue 36's run.
FP8_PATHS = ("nccl", "p2p")


@dataclass(frozen=True)
class Request:
    """What the path rules look at: the call's device, dtype and group size, the plan it was given (if any), the
    group's P2P verdict (asked only where a rule needs it: the first ask is collective), whether NCCL_P2P_DISABLE=1
    is set, and the group's backend."""

    device: torch.device
    dtype: torch.dtype
    world_size: int
    plan: Plan | None
    p2p_reason: Callable[[], str | None]
    nccl_p2p_disabled: bool = False
    backend: str = "nccl"


def _full_precision(path: str, request: Request) -> str | None:
    if request.dtype in HALF_DTYPES or request.plan is not None and request.plan.sequential:
        return None
    if request.dtype in checks.FP8_DTYPES:
        if path in FP8_PATHS:
            return None
        return (f"path={path!r} does not run fp8 (the overlapped fp8 paths: {', '.join(FP8_PATHS)}): use one of "
                "those, or path='auto'")
    return (f"{request.dtype} runs only the matmul-then-collective plan or the reference path (the overlapped "
            "paths are built for bfloat16/float16): use path='auto' with no plan, or cast a and b to bfloat16")


def _needs_cuda(path: str, request: Request | ExpertRequest) -> str | None:
    if request.device.type != "cuda":
        return f"path={path!r} needs CUDA tensors, got tensors on {request.device}; use path='reference'"
    return None


def _needs_nccl(what: str, request: Request | ExpertRequest) -> str | None:
    """``what`` moves its bytes through the group's backend: with CUDA tensors, an NCCL group (see the module
    docstring)."""
    if request.device.type != "cuda" or "nccl" in request.backend.lower():
        return None
    return (f"group has backend {request.backend!r} but the tensors are on {request.device}; CUDA tensors need an "
            f"NCCL group (init_process_group('nccl') or new_group(backend='nccl')) for {what}, which moves its bytes "
            "through the group's backend (path='p2p' moves none through it: any group may bootstrap it)")


def reason_not_reference(request: Request) -> str | None:
    """The reference path runs anywhere the group's backend moves the tensors (gloo on the CPU, NCCL on CUDA)."""
    return _needs_nccl("path='reference'", request)


def reason_not_nccl(request: Request) -> str | None:
    """NCCL: CUDA tensors, an NCCL group; float32 only with a sequential plan (or none: the runtime then makes one)."""
    why = _needs_cuda("nccl", request) or _needs_nccl("path='nccl'", request)
    if why is not None or request.plan is None and request.dtype not in HALF_DTYPES:
        return why
    return _full_precision("nccl", request)


def _p2p_group(request: Request | ExpertRequest) -> str | None:
    """The group's part of the P2P rule (tensor-parallel and expert calls alike): at most ``P2P_MAX_RANKS`` ranks,
    and the group's P2P verdict (asked last: the first ask is collective)."""
    if request.world_size > P2P_MAX_RANKS:
        return f"{request.world_size} ranks: the P2P path serves up to {P2P_MAX_RANKS} (one node)"
    reason = request.p2p_reason()
    return None if reason is None else f"path='p2p' cannot apply to this group: {reason}; use path='nccl'"


def reason_not_p2p(request: Request) -> str | None:
    """P2P: CUDA tensors in half precision (or fp8), every rank on one node with peer access, at most
    ``P2P_MAX_RANKS``; any backend, but a sequential plan's collective needs NCCL."""
    why = _needs_cuda("p2p", request) or _full_precision("p2p", request)
    if why is None and request.plan is not None and request.plan.sequential:
        why = _needs_nccl("a sequential plan (the matmul, then one collective)", request)
    return why or _p2p_group(request)


def reason_not_ring(request: Request) -> str | None:
    """The ring over send/recv runs wherever the group's backend does (gloo on the CPU included); half precision
    on CUDA, over NCCL. It multiplies no fp8 operand anywhere (it reads no scales): an fp8 call with a ring plan that
    is not sequential is refused on the CPU too, where it returned the unscaled product in fp8 (no plan, or a
    sequential one, runs the scaled matmul, then one collective)."""
    if request.device.type != "cuda":
        if request.dtype in checks.FP8_DTYPES and request.plan is not None and not request.plan.sequential:
            return (f"a ring plan does not run fp8 (the overlapped fp8 paths: {', '.join(FP8_PATHS)}, on CUDA); on "
                    "the CPU pass no plan (the scaled matmul, then one collective)")
        return None
    return _needs_nccl("path='ring'", request) or _full_precision("ring", request)


REASON_NOT = {"reference": reason_not_reference, "nccl": reason_not_nccl, "p2p": reason_not_p2p,
              "ring": reason_not_ring}


def reason_not(path: str, request: Request) -> str | None:
    """Why ``path`` cannot serve ``request`` (None: it can)."""
    return REASON_NOT[path](request)


def check_path_name(name: str, path: str, paths: tuple[str, ...] = CALL_PATHS) -> str:
    """``path``, one of ``paths``, or the clear error: an op's call (``explicit_path``, ``expert_path``), and where a
    layer or style is built (its forward may not reach an op's own check: inference, a backward-only use)."""
    if path not in paths:
        raise ValueError(f"{name}: path must be one of {paths}, got {path!r}")
    return path


def explicit_path(name: str, path: str, request: Request) -> str:
    """The path of a call that names one (or, for ``"auto"`` with a plan, follows the plan's); raises the clear
    error where it cannot apply. ``"auto"`` without a plan returns ``"auto"``: see ``automatic_path``."""
    check_path_name(name, path)
    plan_path = None if request.plan is None else request.plan.path
    if path == "auto":
        if request.device.type != "cuda":  # a ring plan runs on gloo too (where the ring takes it); else the reference
            if plan_path != "ring":
                return "reference"
            path = "ring"
        if plan_path is not None:
            path = plan_path
        elif request.dtype not in HALF_DTYPES and request.dtype not in checks.FP8_DTYPES:
            path = "nccl"  # a sequential plan: matmul, then the collective
        else:
            return "auto"
    elif plan_path is not None and path != "reference" and path != plan_path:
        raise ValueError(f"{name}: path={path!r} but the plan given is for path {plan_path!r}; pass a matching plan, "
                         "or path='auto' to follow the plan")
    why = reason_not(path, request)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    return path


def p2p_excluded(reason: str | None, world_size: int, nccl_p2p_disabled: bool) -> str | None:
    """Why ``path="auto"`` must not take P2P on a group (None if it may): ``reason`` is the group's P2P verdict;
    ``nccl_p2p_disabled``: NCCL_P2P_DISABLE=1 is set, a statement that peer-to-peer traffic is off here (or
    emulated off, as in the benchmark's pcie-like setting). Pure: the same inputs on every rank give the same
    answer."""
    if nccl_p2p_disabled:
        return "NCCL_P2P_DISABLE=1 is set"
    if reason is not None:
        return f"P2P does not apply: {reason}"
    if world_size > P2P_MAX_RANKS:
        return f"{world_size} ranks: P2P is used up to {P2P_MAX_RANKS} (one node)"
    return None


def automatic_path(p2p_reason: str | None, world_size: int, nccl_p2p_disabled: bool = False,
                   tuned: Plan | None = None, fp8: bool = False) -> tuple[str, str]:
    """What ``path="auto"`` picks on CUDA for a half-precision or fp8 (``fp8``) call with no plan, and why (pure: the
    same inputs on every rank give the same answer): the path of ``tuned`` (the plan `tune plan --path auto`
    cached for this shape) where it applies, else P2P where it applies (bf16: measured faster than the NCCL path
    and than sequential at every op of the nvlink grid, benchmarks/results/h200x2-nvlink.json; fp8: where
    ``FP8_PATHS`` has it, the same schedule), else NCCL."""
    excluded = p2p_excluded(p2p_reason, world_size, nccl_p2p_disabled)
    if fp8 and "p2p" not in FP8_PATHS:
        excluded = "the P2P path does not run fp8"
    if tuned is not None and (tuned.path == "nccl" or excluded is None):
        return tuned.path, f"the tuned plan for this shape (`tune plan --path auto`) is on {tuned.path}"
    if excluded is not None:
        return "nccl", excluded
    return "p2p", "every rank on one node with peer access between all GPUs"


# -- the plan of a call that gives none -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Call:
    """What an fp8 call's plan rule looks at: the scaling mode, the output dtype's bytes, the bytes one gathered row
    moves (all-gather), and whether ``torch._scaled_mm``'s block-wise kernel takes the operands (cuBLAS bands)."""

    mode: str
    out_size: int
    row_bytes: int
    cublas_block: bool


@dataclass(frozen=True)
class Facts:
    """A first call's facts, gathered once (``runtime/plans.call_facts``): the path rules' ``request``, the op and
    its shape (all-gather: the gathered M), the device's SMs, an fp8 call's ``fp8``, and the group's two answers
    that cost a collective, asked only where a rule needs them and kept by the group's context: ``tuned(path)``,
    the plan cache's plan for this call under a path (None off CUDA or where none is cached), and
    ``rates(dtype)``, the measured GEMM and all-reduce rates."""

    op: str
    shape: tuple[int, int, int]
    request: Request
    num_sms: int
    tuned: Callable[[str], Plan | None]
    rates: Callable[[torch.dtype], Rates]
    fp8: Fp8Call | None = None


def decide(name: str, path: str, facts: Facts) -> tuple[str, Plan | None, str | None]:
    """The path a call takes (``path`` as asked), its plan where none is given (None where one is), and for
    ``path="auto"`` why that path (else None), in one pass: the path rules (the clear error where the path cannot
    apply); for ``"auto"``, the tuned plan's path or ``automatic_path``'s; the tuned plan for the shape, else
    ``plan_of``'s. With CUDA tensors on a group that is not NCCL only the P2P path applies, and only with a plan
    that overlaps: anything else raises the clear error."""
    request = facts.request
    path = explicit_path(name, path, request)
    tuned = why = None
    if path == "auto":
        tuned = facts.tuned("auto")
        reason = None if request.nccl_p2p_disabled else request.p2p_reason()
        if tuned is not None and tuned.path != "p2p" and "nccl" not in request.backend.lower():
            tuned = None  # a plan tuned for NCCL cannot serve this group
        path, why = automatic_path(reason, request.world_size, request.nccl_p2p_disabled, tuned,
                                   fp8=request.dtype in checks.FP8_DTYPES)
        refused = None if path == "p2p" else _needs_nccl(f"path={path!r}", request)
        if refused is not None:
            raise ValueError(f"{name}: {refused}; path='auto' cannot take the P2P path here: {why}")
        tuned = tuned if tuned is not None and tuned.path == path else None
    if request.plan is not None:
        return path, None, why
    refused = _needs_nccl("a sequential plan (the matmul, then one collective)", request)
    plan = tuned or plan_of(path, facts)
    if plan.sequential and refused is not None:
        raise ValueError(f"{name}: {facts.op} of (M, N, K) = {facts.shape} over {request.world_size} ranks is too "
                         f"small to overlap on path {path!r}, so its plan is sequential; {refused}")
    return path, plan, why


def plan_of(path: str, facts: Facts, tuned: bool = True) -> Plan:
    """The plan of a call on ``path`` (a path, not ``"auto"``) that gives none: fp8 on CUDA, ``tune/fp8.py``'s
    (on NCCL, overlap or not by the collective's time over the fp8 GEMM's: the bf16 rates, the GEMM
    ``FP8_GEMM_SPEEDUP`` times faster, the bytes the call moves); float32 (and the reference path on CUDA), the
    sequential plan; else the plan tuned for the shape (``tuned``), or the default plan for the path, sized on NCCL
    by the group's measured rates (the collective's time over the GEMM's)."""
    request, op, (m, n, k) = facts.request, facts.op, facts.shape
    world, dtype, cuda = request.world_size, request.dtype, request.device.type == "cuda"
    if facts.fp8 is not None and cuda and path in FP8_PATHS:
        return _fp8_plan(path, facts)
    if dtype not in HALF_DTYPES or path == "reference" and cuda:
        return sequential_plan(op, m, n, k, world)
    path = path if path in ("p2p", "ring") else "nccl"
    found = facts.tuned(path) if tuned else None
    if found is not None:
        return found
    comm_ratio = None
    if cuda and path == "nccl":  # the ring's and P2P's transfers take no SM: no rates needed
        measured = facts.rates(dtype)
        moved = m * (k if op == "all_gather" else n) * dtype.itemsize  # all-gather moves A, the others C
        # Rounded so that nearby ratios share a cached plan; identical on every rank (the rates are agreed).
        comm_ratio = round(measured.collective_ms(op, moved, world) / measured.gemm_ms(m, n, k), 2)
    # A group that is not NCCL has no collective to fall back on (P2P bootstrapped by gloo): overlap even where a
    # sequential plan would be as fast (``decide`` raises where the schedule cannot split the shape).
    overlap_only = cuda and "nccl" not in request.backend.lower()
    return default_plan(op, m, n, k, world, num_sms=facts.num_sms, element_size=dtype.itemsize, comm_ratio=comm_ratio,
                        path=path if cuda or path == "ring" else "nccl",  # off CUDA: the reference, or the ring
                        allow_sequential=not overlap_only)


def captured_plan(plan: Plan, single_queue: bool) -> Plan:
    """The plan a call runs inside a user's CUDA-graph capture: its own, but for the NCCL path's reductions under one
    hardware queue (``single_queue``: ``CUDA_DEVICE_MAX_CONNECTIONS=1``), whose counter waits become graph kernels
    that spin until the GEMM's tiles arrive: there, cuBLAS bands whose events are graph edges. A graph launches its
    independent branches in an order of its own (the reason the library never replays under that setting), and on
    one queue a spinning wait placed before the GEMM, with a collective queued behind it, would hold the GEMM back
    for ever; an edge cannot."""
    if single_queue and plan.path == "nccl" and plan.counts_tiles:
        return dataclasses.replace(plan, gemm="cublas")
    return plan


def _fp8_plan(path: str, facts: Facts) -> Plan:
    request, op, (m, n, k), fp8 = facts.request, facts.op, facts.shape, facts.fp8
    world = request.world_size
    comm_ratio = None
    if path == "nccl":
        measured = facts.rates(torch.bfloat16)
        moved = m * fp8.row_bytes if op == "all_gather" else m * n * fp8.out_size
        gemm_ms = measured.gemm_ms(m, n, k) / fp8_rules.FP8_GEMM_SPEEDUP
        comm_ratio = round(measured.collective_ms(op, moved, world) / gemm_ms, 2)
    # Bands of cuBLAS's block-wise kernel only where it takes every band: they end at tile rows inside each rank block.
    block_rows = m if op == "all_reduce" else m // world
    return fp8_rules.fp8_plan(op, m, n, k, world, fp8.mode, path=path, num_sms=facts.num_sms, comm_ratio=comm_ratio,
                              out_size=fp8.out_size, cublas_block=block_rows % 4 == 0 and fp8.cublas_block)


# -- expert-parallel (MoE) calls: dispatch and combine (``runtime/experts.py``) -----------------------------------
# The expert paths a caller names. Their rules look at what the GEMM rules do, plus which expert communicators the
# runtime's table holds (the NCCL and P2P ones are built separately: a path whose communicator is absent does not
# apply, and "auto" passes it by).
EXPERT_PATHS = ("auto", "nccl", "p2p", "reference")


@dataclass(frozen=True)
class ExpertRequest:
    """What the expert path rules look at: the call's device, dtype and group size, the expert paths the table
    can build (``available``), the group's P2P verdict (asked only where a rule needs it: the first ask is
    collective), whether NCCL_P2P_DISABLE=1 is set, and the group's backend."""

    device: torch.device
    dtype: torch.dtype
    world_size: int
    available: frozenset
    p2p_reason: Callable[[], str | None]
    nccl_p2p_disabled: bool = False
    backend: str = "nccl"


def _expert_built(path: str, request: ExpertRequest) -> str | None:
    if path not in request.available:
        return f"no expert communicator for path={path!r} is installed in this version; use path='reference'"
    return None


def reason_not_expert_reference(request: ExpertRequest) -> str | None:
    """The reference expert path runs anywhere the group's backend moves the rows (gloo on the CPU, NCCL on
    CUDA)."""
    return _needs_nccl("path='reference'", request)


def reason_not_expert_nccl(request: ExpertRequest) -> str | None:
    """NCCL expert path: CUDA tensors, an NCCL group, its communicator installed."""
    return _needs_cuda("nccl", request) or _needs_nccl("path='nccl'", request) or _expert_built("nccl", request)


def reason_not_expert_p2p(request: ExpertRequest) -> str | None:
    """P2P expert path: CUDA tensors in half precision, its communicator installed, every rank on one node with
    peer access, at most ``P2P_MAX_RANKS``; any backend (the group only bootstraps the peers' mapping)."""
    why = _needs_cuda("p2p", request) or _expert_built("p2p", request)
    if why is None and request.dtype not in HALF_DTYPES:
        why = f"path='p2p' runs bfloat16/float16, got {request.dtype}; use path='nccl'"
    return why or _p2p_group(request)


EXPERT_REASON_NOT = {"reference": reason_not_expert_reference, "nccl": reason_not_expert_nccl,
                     "p2p": reason_not_expert_p2p}


def expert_path(name: str, path: str, request: ExpertRequest) -> tuple[str, str]:
    """The path of an expert call and why: a named path where its rule allows it (else the clear error); for
    ``"auto"``: the reference off CUDA; on CUDA P2P where its rule allows it and NCCL_P2P_DISABLE is unset, else
    NCCL where installed, else the reference (on a group that is not NCCL: P2P, or the clear error). Pure but for
    the P2P verdict (the same on every rank)."""
    check_path_name(name, path, EXPERT_PATHS)
    if path != "auto":
        why = EXPERT_REASON_NOT[path](request)
        if why is not None:
            raise ValueError(f"{name}: {why}")
        return path, "asked for"
    if request.device.type != "cuda":
        return "reference", f"tensors on {request.device}"
    p2p_why = "NCCL_P2P_DISABLE=1 is set" if request.nccl_p2p_disabled else reason_not_expert_p2p(request)
    if p2p_why is None:
        return "p2p", "every rank on one node with peer access between all GPUs"
    if reason_not_expert_nccl(request) is None:
        return "nccl", p2p_why
    refused = _needs_nccl("path='nccl' or 'reference'", request)
    if refused is not None:
        raise ValueError(f"{name}: {refused}; path='auto' cannot take the P2P path here: {p2p_why}")
    return "reference", f"{p2p_why}; {_expert_built('nccl', request)}"
