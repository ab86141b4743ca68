"""Path policy, every rule in one place: which paths a call may take (one predicate per path that returns why it
cannot, in the spirit of PyTorch's ``_should_use_*``), and which one ``path="auto"`` takes.

Paths a caller names: ``"auto"``, ``"nccl"``, ``"p2p"``, ``"ring"``, ``"reference"`` (``CALL_PATHS``). A plan names
the communicator it is for (``Plan.path``); a plan marked sequential runs the matmul-then-collective communicator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashoverlap.plan import P2P_MAX_RANKS, Plan
from flashoverlap.runtime import checks

CALL_PATHS = ("auto", "nccl", "p2p", "ring", "reference")
# The overlapped paths are built and measured for half precision, and those in FP8_PATHS for fp8 too; float32 calls
# (and fp8 ones elsewhere) run the plain (scaled) matmul and one collective (a sequential plan) on CUDA, and the
# reference path elsewhere.
HALF_DTYPES = checks.HALF_DTYPES
# P2P in fp8: the bf16 schedule with scaled cuBLAS sub-bands (0.94-1.02x one whole ``torch._scaled_mm`` on one H200,
# h200x1-fp8-gemm.json); its mechanics checked on one GPU with two processes, eager and replayed
# (benchmarks/diagnostics/p2p_fp8_one_gpu.py, logs/issue35); its two-GPU speed is issue 36's run.
FP8_PATHS = ("nccl", "p2p")


@dataclass(frozen=True)
class Request:
    """What the path rules look at: the call's device, dtype and group size, the plan it was given (if any), and
    the group's P2P verdict (asked only where a rule needs it: the first ask is collective)."""

    device: torch.device
    dtype: torch.dtype
    world_size: int
    plan: Plan | None
    p2p_reason: Callable[[], str | None]
    nccl_p2p_disabled: bool = False


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


def _needs_cuda(path: str, request: Request) -> str | None:
    if request.device.type != "cuda":
        return f"path={path!r} needs CUDA tensors, got tensors on {request.device}; use path='reference'"
    return None


def reason_not_reference(request: Request) -> str | None:
    """The reference path runs anywhere."""
    return None


def reason_not_nccl(request: Request) -> str | None:
    """NCCL: CUDA tensors; float32 only with a sequential plan (or none: the runtime then makes one)."""
    if request.plan is None and request.dtype not in HALF_DTYPES:
        return _needs_cuda("nccl", request)
    return _needs_cuda("nccl", request) or _full_precision("nccl", request)


def _p2p_group(request: Request | ExpertRequest) -> str | None:
    """The group's part of the P2P rule (tensor-parallel and expert calls alike): at most ``P2P_MAX_RANKS`` ranks,
    and the group's P2P verdict (asked last: the first ask is collective)."""
    if request.world_size > P2P_MAX_RANKS:
        return f"{request.world_size} ranks: the P2P path serves up to {P2P_MAX_RANKS} (one node)"
    reason = request.p2p_reason()
    return None if reason is None else f"path='p2p' cannot apply to this group: {reason}; use path='nccl'"


def reason_not_p2p(request: Request) -> str | None:
    """P2P: CUDA tensors in half precision, every rank on one node with peer access, at most ``P2P_MAX_RANKS``."""
    why = _needs_cuda("p2p", request) or _full_precision("p2p", request)
    return why or _p2p_group(request)


def reason_not_ring(request: Request) -> str | None:
    """The ring over send/recv runs wherever the group's backend does (gloo on the CPU included); half precision
    on CUDA."""
    return _full_precision("ring", request) if request.device.type == "cuda" else None


REASON_NOT = {"reference": reason_not_reference, "nccl": reason_not_nccl, "p2p": reason_not_p2p,
              "ring": reason_not_ring}


def reason_not(path: str, request: Request) -> str | None:
    """Why ``path`` cannot serve ``request`` (None: it can)."""
    return REASON_NOT[path](request)


def explicit_path(name: str, path: str, request: Request) -> str:
    """The path of a call that names one (or, for ``"auto"`` with a plan, follows the plan's); raises the clear
    error where it cannot apply. ``"auto"`` without a plan returns ``"auto"``: see ``automatic_path``."""
    if path not in CALL_PATHS:
        raise ValueError(f"{name}: path must be one of {CALL_PATHS}, got {path!r}")
    plan_path = None if request.plan is None else request.plan.path
    if path == "auto":
        if request.device.type != "cuda":  # a ring plan runs on gloo too; anything else is the reference
            return "ring" if plan_path == "ring" else "reference"
        if plan_path is not None:
            path = plan_path
        elif request.dtype not in HALF_DTYPES and request.dtype not in checks.FP8_DTYPES:
            return "nccl"  # a sequential plan: matmul, then the collective
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
    same inputs on every rank give the same answer): the path of ``tuned`` (the plan `tune plan --path auto` cached
    for this shape) where it applies, else P2P where it applies (bf16: measured faster than the NCCL path and than
    sequential at every op of the nvlink grid, benchmarks/results/h200x2-nvlink.json; fp8: where ``FP8_PATHS`` has
    it, the same schedule), else NCCL."""
    excluded = p2p_excluded(p2p_reason, world_size, nccl_p2p_disabled)
    if fp8 and "p2p" not in FP8_PATHS:
        excluded = "the P2P path does not run fp8"
    if tuned is not None and (tuned.path == "nccl" or excluded is None):
        return tuned.path, f"the tuned plan for this shape (`tune plan --path auto`) is on {tuned.path}"
    if excluded is not None:
        return "nccl", excluded
    return "p2p", "every rank on one node with peer access between all GPUs"


# -- expert-parallel (MoE) calls: dispatch and combine (``runtime/experts.py``) -----------------------------------
# The expert paths a caller names. Their rules look at what the GEMM rules do, plus which expert communicators the
# runtime's table holds (the NCCL and P2P ones are built separately: a path whose communicator is absent does not
# apply, and "auto" passes it by).
EXPERT_PATHS = ("auto", "nccl", "p2p", "reference")


@dataclass(frozen=True)
class ExpertRequest:
    """What the expert path rules look at: the call's device, dtype and group size, the expert paths the table
    can build (``available``), the group's P2P verdict (asked only where a rule needs it: the first ask is
    collective) and whether NCCL_P2P_DISABLE=1 is set."""

    device: torch.device
    dtype: torch.dtype
    world_size: int
    available: frozenset
    p2p_reason: Callable[[], str | None]
    nccl_p2p_disabled: bool = False


def _expert_built(path: str, request: ExpertRequest) -> str | None:
    if path not in request.available:
        return f"no expert communicator for path={path!r} is installed in this version; use path='reference'"
    return None


def reason_not_expert_reference(request: ExpertRequest) -> str | None:
    """The reference expert path runs anywhere ``all_to_all_single`` does (gloo included)."""
    return None


def reason_not_expert_nccl(request: ExpertRequest) -> str | None:
    """NCCL expert path: CUDA tensors, its communicator installed."""
    if request.device.type != "cuda":
        return f"path='nccl' needs CUDA tensors, got tensors on {request.device}; use path='reference'"
    return _expert_built("nccl", request)


def reason_not_expert_p2p(request: ExpertRequest) -> str | None:
    """P2P expert path: CUDA tensors in half precision, its communicator installed, every rank on one node with
    peer access, at most ``P2P_MAX_RANKS``."""
    if request.device.type != "cuda":
        return f"path='p2p' needs CUDA tensors, got tensors on {request.device}; use path='reference'"
    why = _expert_built("p2p", request)
    if why is None and request.dtype not in HALF_DTYPES:
        why = f"path='p2p' runs bfloat16/float16, got {request.dtype}; use path='nccl'"
    return why or _p2p_group(request)


EXPERT_REASON_NOT = {"reference": reason_not_expert_reference, "nccl": reason_not_expert_nccl,
                     "p2p": reason_not_expert_p2p}


def expert_path(name: str, path: str, request: ExpertRequest) -> tuple[str, str]:
    """The path of an expert call and why: a named path where its rule allows it (else the clear error); for
    ``"auto"``: the reference off CUDA; on CUDA P2P where its rule allows it and NCCL_P2P_DISABLE is unset, else
    NCCL where installed, else the reference. Pure but for the P2P verdict (the same on every rank)."""
    if path not in EXPERT_PATHS:
        raise ValueError(f"{name}: path must be one of {EXPERT_PATHS}, got {path!r}")
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
    return "reference", f"{p2p_why}; {_expert_built('nccl', request)}"
