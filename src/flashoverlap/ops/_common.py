"""What every op does before launching: argument checks, the group, and the plan (given, or the default for the
shape, chosen from the machine's rates). Repeated calls of one shape skip the group checks and the plan lookup:
host time before the first launch is GPU idle time when the GPU has nothing queued."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
import zlib

import torch
import torch.distributed as dist

from flashoverlap.comm import reference, sequential
from flashoverlap.comm.collectives import all_gather_into_tensor
from flashoverlap.comm.nccl import debug_timeout
from flashoverlap.comm.state import GroupState, existing_state, state_of
from flashoverlap.comm.symmetric import p2p_excluded
from flashoverlap.ops._checks import HALF_DTYPES, PATHS, check_group, check_operands, choose_path
from flashoverlap.plan import OPS, Plan, default_plan, sequential_plan
from flashoverlap.tune import cache, rates

_LOG = logging.getLogger("flashoverlap")


@functools.lru_cache(maxsize=512)
def _default_plan(op: str, m: int, n: int, k: int, world_size: int, num_sms: int, element_size: int,
                  comm_ratio: float | None, path: str = "nccl") -> Plan:
    return default_plan(op, m, n, k, world_size, num_sms=num_sms, element_size=element_size, comm_ratio=comm_ratio,
                        path=path)


def _cached_plan(op: str, m: int, n: int, k: int, state: GroupState, dtype: torch.dtype,
                 path: str) -> Plan | None:
    """The plan cache's plan for this call under ``path`` (``"auto"``: `tune plan --path auto`'s): the shape's
    own, the nearest tuned M's, or None. Collective on a group's first lookup (rank 0's entries are agreed)."""
    device = state.device
    key = cache.cache_key(torch.cuda.get_device_name(device), state.world_size, op, path,
                          str(dtype).replace("torch.", ""))
    with torch.cuda.device(device):  # the exchange's tensors go to this device
        entries = cache.agreed_entries(state, key)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return cache.select(entries, op, m, n, k, state.world_size, num_sms)


def plan_for(op: str, m: int, n: int, k: int, group: dist.ProcessGroup, device: torch.device,
             dtype: torch.dtype, path: str = "nccl", tuned: bool = True) -> Plan:
    """The plan a call of ``op`` at this shape uses when none is given: on CUDA, the tuned plan from the plan cache
    (``tune/cache.py``: this shape's, or the nearest tuned M's) where there is one (and ``tuned``); otherwise the
    default plan. For that, the first NCCL-path call for a group measures the machine's GEMM and all-reduce rates
    (collectively) to choose between overlap and sequential (the P2P path needs no rates: its transfers take no
    SM). ``tuned=False``: the default plan regardless of the cache (the benchmark's hand-set comparison)."""
    world_size = dist.get_world_size(group)
    element_size = torch.empty((), dtype=dtype).element_size()
    if device.type != "cuda":  # the reference path, or the ring over gloo
        return _default_plan(op, m, n, k, world_size, 132, element_size, None, "ring" if path == "ring" else "nccl")
    state = state_of(group, device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    cached = _cached_plan(op, m, n, k, state, dtype, path) if tuned else None
    if cached is not None:
        return cached
    if path in ("p2p", "ring"):
        return _default_plan(op, m, n, k, world_size, num_sms, element_size, None, path)
    measured = rates.measure(state, dtype)
    moved = m * (k if op == "all_gather" else n) * element_size  # all-gather moves A, the others C
    comm_ms = measured.collective_ms(op, moved, world_size)
    # Rounded so that nearby ratios share a cached plan; identical on every rank (the rates are agreed).
    return _default_plan(op, m, n, k, world_size, num_sms, element_size, round(comm_ms / measured.gemm_ms(m, n, k), 2))


# The ops for which path="auto" takes P2P where it applies, when no tuned plan says otherwise: where the P2P path
# (cuBLAS and copy engines, comm/ring_schedule.py) was measured faster than the NCCL path and than sequential at
# the nvlink grid (benchmarks/results/h200x2-nvlink.json). `tune plan --path auto` replaces this rule by
# measurement, shape by shape.
AUTO_P2P_OPS = frozenset({"all_reduce", "reduce_scatter", "all_gather"})


def automatic_path(op: str, p2p_reason: str | None, world_size: int, nccl_p2p_disabled: bool = False,
                   tuned: Plan | None = None) -> tuple[str, str]:
    """What path="auto" picks for ``op`` on a group, and why (pure: the same inputs on every rank give the same
    answer): the path of ``tuned`` (the plan `tune plan --path auto` cached for this shape) where it applies,
    else P2P for ``AUTO_P2P_OPS`` where it applies, else NCCL. Explicit ``path="p2p"`` works regardless."""
    excluded = p2p_excluded(p2p_reason, world_size, nccl_p2p_disabled)
    if tuned is not None and (tuned.path == "nccl" or excluded is None):
        return tuned.path, f"the tuned plan for this shape (`tune plan --path auto`) is on {tuned.path}"
    if op not in AUTO_P2P_OPS:
        return "nccl", f"P2P is not chosen automatically for {op}: it was not faster than the NCCL path there"
    if excluded is not None:
        return "nccl", excluded
    return "p2p", "every rank on one node with peer access between all GPUs"


def _automatic_path(op: str, m: int, n: int, k: int, state: GroupState,
                    dtype: torch.dtype) -> tuple[str, Plan | None]:
    """The path (and the tuned plan, if one decided it) for a path="auto" call; collective on first use."""
    disabled = os.environ.get("NCCL_P2P_DISABLE") == "1"
    tuned = _cached_plan(op, m, n, k, state, dtype, "auto")
    # Collective (once per group), and only where the answer can matter; every rank takes the same branch.
    wanted = not disabled and (op in AUTO_P2P_OPS or (tuned is not None and tuned.path == "p2p"))
    reason = state.p2p_reason() if wanted else None
    path, why = automatic_path(op, reason, state.world_size, disabled, tuned)
    if ("auto", op) not in state.logged:
        state.logged.add(("auto", op))
        _LOG.debug("flashoverlap: path='auto' uses %s for %s on %s: %s", path, op, state.name, why)
    return path, tuned if tuned is not None and tuned.path == path else None


def prepare_call(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                 plan: Plan | None, path: str) -> tuple[str, GroupState, Plan]:
    """Check a call of op ``name`` (plan kind ``op``) and return its path, group state and plan."""
    m, n, k = check_operands(name, a, b)  # for all-gather, m is this rank's shard
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"{name}: plan must be a flashoverlap.Plan, got {type(plan).__name__}")
    full_precision = a.dtype not in HALF_DTYPES
    automatic = path == "auto" and plan is None and a.device.type == "cuda" and not full_precision
    path = choose_path(name, path, a.device, None if plan is None else plan.path)
    if full_precision and (path in ("p2p", "ring") or (plan is not None and not plan.sequential)):
        raise ValueError(f"{name}: {a.dtype} runs only the matmul-then-collective plan or the reference path (the "
                         "overlapped paths' kernels are bfloat16/float16): use path='auto' with no plan, or cast a "
                         "and b to torch.bfloat16")
    resolved = group if group is not None or not dist.is_initialized() else dist.group.WORLD
    state = existing_state(resolved, a.device)
    if state is None:  # the group's first call on this device: check it once
        state = state_of(check_group(name, group, a.device), a.device)
    key = (op, a.dtype, m, n, k, path, automatic, plan is None)
    seen = state.calls.get(key)
    world_size = state.world_size
    if op == "all_gather":
        m *= world_size  # a is this rank's shard: the plan is for the gathered M
    if seen is not None:
        default, path = seen
    else:
        if op == "reduce_scatter" and m % world_size:
            raise ValueError(
                f"{name}: a has M = {m} rows, which the {world_size} ranks of group cannot share evenly: "
                "reduce-scatter gives each rank M / world_size rows (pad M to a multiple of the world size)"
            )
        tuned = None
        if automatic:
            path, tuned = _automatic_path(op, m, n, k, state, a.dtype)
        elif path == "p2p":
            reason = state.p2p_reason()
            if reason is not None:
                raise ValueError(f"{name}: path='p2p' cannot apply to this group: {reason}; use path='nccl'")
        plan_path = path if path in ("p2p", "ring") else "nccl"
        if plan is not None:
            default = None
        elif full_precision:
            default = sequential_plan(op, m, n, k, world_size)
        else:
            default = tuned or plan_for(op, m, n, k, state.group, a.device, a.dtype, plan_path)
        if len(state.calls) > 1024:
            state.calls.clear()
        state.calls[key] = (default, path)
    plan = default if plan is None else plan
    if (plan.op, plan.m, plan.n, plan.k, plan.world_size) != (op, m, n, k, world_size):
        raise ValueError(
            f"{name}: plan is for {plan.op} (m, n, k) = {(plan.m, plan.n, plan.k)} over {plan.world_size} ranks, "
            f"but this call is {op} {(m, n, k)} over {world_size} ranks"
        )
    return path, state, plan


def needs_library(a: torch.Tensor, b: torch.Tensor, plan: Plan | None, name: str) -> bool:
    """Whether a public op call goes through its custom op (``ops/library.py``): where autograd must record it, or
    ``torch.compile`` traces it. Plain eager calls skip the dispatcher (host time)."""
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (a, b))
    if grad and plan is not None:
        raise ValueError(f"{name}: plan= cannot be combined with autograd (an input requires grad); leave plan unset "
                         "(the library's plan for the shape, tuned where the plan cache has one) or detach the inputs")
    return grad or torch.compiler.is_compiling()


def execute(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
            plan: Plan | None, path: str, return_gathered: bool = False,
            hook=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every op's body: check, choose path and plan, and run the call through the path's communicator
    (``comm/__init__.py``). Returns the result, and all-gather's gathered input where ``return_gathered``.
    ``hook()``: independent work for the caller's stream that the call may overlap with its communication (the
    P2P path runs it where it would wait for its first pull; the others once the op is issued)."""
    if debug_timeout() is not None:  # before any collective of the call (plan lookups may run some)
        check_agreement(name, op, a, b, group, plan, path)
    path, state, plan = prepare_call(name, op, a, b, group, plan, path)
    on_device = torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext()
    if path == "reference" or plan.sequential:
        if path == "reference":
            result = reference.run(plan, a, b, state.group, state.rank, return_gathered)
        else:
            with on_device:
                result = sequential.run(plan, a, b, state.group, return_gathered)
        if hook is not None:
            hook()
        return result
    communicator = state.p2p if path == "p2p" else state.ring if path == "ring" else state.nccl
    with on_device:
        return communicator.run(plan, a, b, name, return_gathered, hook)


_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def check_agreement(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                    plan: Plan | None, path: str) -> None:
    """Debug mode (``FLASHOVERLAP_DEBUG_TIMEOUT`` set), before anything else of the call: every rank of the group
    calls the same op with the same shapes, dtype, path and plan, or every rank raises before any collective or
    launch (one small all-gather; a first call's plan lookup can itself be collective). A rank that never comes to
    the call (it skipped it, or raised before it) makes the others raise when the timeout passes, naming the rank,
    the op and the group, instead of hanging; the group is unusable after that (its collective is still pending):
    destroy it."""
    m, n, k = check_operands(name, a, b)
    if path not in PATHS:
        return  # choose_path raises the clear error
    state = existing_state(group if group is not None or not dist.is_initialized() else dist.group.WORLD,
                           a.device) or state_of(check_group(name, group, a.device), a.device)
    dtype = a.dtype
    if a_capture_is_running():
        return
    mine = [OPS.index(op), m, n, k, _DTYPE_CODES[dtype], PATHS.index(path), 0 if plan is None else _digest(plan)]
    device = state.device if state.device.type == "cuda" else torch.device("cpu")
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    everyone = torch.empty(state.world_size * len(mine), dtype=torch.int64, device=device)
    work = all_gather_into_tensor(everyone, local, state.group, async_op=True)
    timeout = debug_timeout()
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"flashoverlap: rank {state.rank}: {name} on {state.name} waited more than {timeout:g} s "
                "(FLASHOVERLAP_DEBUG_TIMEOUT) for the other ranks to reach the call: a rank skipped it, raised "
                "before it, or is stuck elsewhere; the group is unusable now"
            )
        time.sleep(1e-4)
    work.wait()
    rows = everyone.view(state.world_size, len(mine)).tolist()
    for rank, row in enumerate(rows):
        if row != rows[0]:
            fields = ("op", "M", "N", "K", "dtype", "path", "plan")  # M: all-gather's shard rows
            differ = [f for f, x, y in zip(fields, row, rows[0]) if x != y]
            raise ValueError(
                f"{name}: rank {state.rank} of {state.name}: the ranks disagree on {', '.join(differ)} (rank "
                f"{rank} differs from rank 0): every rank must call the op with the same shapes, dtype and path"
            )


@functools.lru_cache(maxsize=256)
def _digest(plan: Plan) -> int:
    """The same number for the same plan on every rank (``hash`` of a str is salted per process)."""
    return zlib.crc32(json.dumps(plan.to_dict(), sort_keys=True).encode())


def a_capture_is_running() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
