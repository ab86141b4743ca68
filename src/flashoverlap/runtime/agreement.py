"""Debug mode's agreement check (``FLASHOVERLAP_DEBUG_TIMEOUT``): before anything else of a call, every rank of the
group must be making the same call."""

from __future__ import annotations

import functools
import json
import time
import zlib

import torch
import torch.distributed as dist

from flashoverlap import guards
from flashoverlap.comm.collectives import all_gather_into_tensor
from flashoverlap.plan import OPS, Plan
from flashoverlap.runtime import policy
from flashoverlap.runtime.checks import check_operands
from flashoverlap.runtime.context import GroupContext, group_context

DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}  # the same number on every rank


def check(name: str, op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
          plan: Plan | None, path: str, timeout: float) -> None:
    """Debug mode (``FLASHOVERLAP_DEBUG_TIMEOUT`` set), before anything else of the call: every rank of the group
    calls the same op with the same shapes, dtype, path and plan, or every rank raises before any collective or
    launch (one small all-gather; a first call's plan lookup can itself be collective). A rank that never comes to
    the call (it skipped it, or raised before it) makes the others raise when the timeout passes, naming the rank,
    the op and the group, instead of hanging; the group is unusable after that (its collective is still pending):
    destroy it."""
    m, n, k = check_operands(name, a, b)
    if path not in policy.CALL_PATHS:
        return  # resolve raises the clear error
    context = group_context(name, group, a.device)
    if guards.capturing():
        return
    mine = [OPS.index(op), m, n, k, DTYPE_CODES[a.dtype], policy.CALL_PATHS.index(path),
            0 if plan is None else _digest(plan)]
    device = context.device if context.device.type == "cuda" else torch.device("cpu")
    rows = gather_rows(name, context, torch.tensor(mine, dtype=torch.int64, device=device), timeout)
    for rank, row in enumerate(rows):
        if row != rows[0]:
            fields = ("op", "M", "N", "K", "dtype", "path", "plan")  # M: all-gather's shard rows
            differ = [f for f, x, y in zip(fields, row, rows[0]) if x != y]
            raise ValueError(
                f"{name}: rank {context.rank} of {context.name}: the ranks disagree on {', '.join(differ)} (rank "
                f"{rank} differs from rank 0): every rank must call the op with the same shapes, dtype and path"
            )


def gather_rows(name: str, context: GroupContext, local: torch.Tensor, timeout: float) -> list[list[int]]:
    """Every rank's ``local`` (int64, the same length on every rank), by rank: one all-gather, waited for with
    debug mode's deadline (``guards.poll_until``), so that a rank that never comes to the call makes the others
    raise, naming the rank, the call and the group, instead of hanging."""
    everyone = torch.empty(context.world_size * local.numel(), dtype=torch.int64, device=local.device)
    work = all_gather_into_tensor(everyone, local, context.process_group, async_op=True)
    guards.poll_until(work.is_completed, time.monotonic() + timeout, lambda: (
        f"flashoverlap: rank {context.rank}: {name} on {context.name} waited more than {timeout:g} s "
        "(FLASHOVERLAP_DEBUG_TIMEOUT) for the other ranks to reach the call: a rank skipped it, raised "
        "before it, or is stuck elsewhere; the group is unusable now"))
    work.wait()
    return everyone.view(context.world_size, -1).tolist()


@functools.lru_cache(maxsize=256)
def _digest(plan: Plan) -> int:
    """The same number for the same plan on every rank (``hash`` of a str is salted per process)."""
    return zlib.crc32(json.dumps(plan.to_dict(), sort_keys=True).encode())


