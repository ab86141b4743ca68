"""Ranks that stay up between tests: ``Ranks(world)`` starts ``world`` gloo processes once (``file://`` init, no
fixed port) and runs one job at a time on all of them (``run(fn, *args)``: ``fn(rank, world, *args)`` in each, the
results in rank order, a rank's traceback raised in the parent). Process start-up (torch, flashoverlap) costs
seconds per rank on the CPU machines, so the MoE tests share one set of ranks per world size.

Inside the ranks, ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` return tensors poisoned with NaN
(floating) or a huge value (integers): an output row the ops never write shows as NaN, an unwritten index as an
out-of-range error. The ranks are this test session's own processes, so the stand-ins leak into no other test.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from flashoverlap.testing import FAILURE_GRACE, apply_environ, rank_context

_INT_POISON = 1 << 40


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype in (torch.int64, torch.int32):
        return t.fill_(min(_INT_POISON, torch.iinfo(t.dtype).max))
    return t


def poison_allocations() -> None:
    """Stand-ins for the allocation functions the library uses (this process only)."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    torch.empty = lambda *args, **kwargs: _poisoned(empty(*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: _poisoned(empty_like(*args, **kwargs))
    torch.Tensor.new_empty = lambda self, *args, **kwargs: _poisoned(new_empty(self, *args, **kwargs))


def _serve(rank: int, world: int, init_file: str, environ: dict, jobs, results) -> None:
    apply_environ(environ)  # the environment at the start of the ranks, not the forkserver's (testing.rank_context)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    poison_allocations()
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                results.put((rank, "ok", fn(rank, world, *args)))
            except BaseException:  # every failure, assertion errors included, goes to the parent
                results.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class Ranks:
    """``world`` gloo ranks kept up between jobs (see the module docstring)."""

    def __init__(self, world: int) -> None:
        self.world = world
        environ = dict(os.environ)
        ctx = rank_context(environ)
        self._tmp = tempfile.TemporaryDirectory(prefix="flashoverlap-moe-")
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self._jobs = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_serve, args=(r, world, init_file, environ, self._jobs[r], self._results),
                                   daemon=True) for r in range(world)]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable, *args, timeout: float = 300.0) -> list[Any]:
        """``fn(rank, world, *args)`` on every rank; the results in rank order."""
        if self.broken:
            raise RuntimeError("these ranks timed out in an earlier job")
        for jobs in self._jobs:
            jobs.put((fn, args))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            for _ in range(self.world):
                # Once a rank has failed, the others may wait for it in a collective: give them a little while.
                rank, status, payload = self._results.get(timeout=FAILURE_GRACE if errors else timeout)
                (results if status == "ok" else errors)[rank] = payload
        except queue.Empty:
            self.broken = True
            self.close()
            if not errors:
                raise RuntimeError(f"ranks did not all report within {timeout} s (a rank hangs in a collective)"
                                   ) from None
        if errors:
            first = min(errors)
            raise RuntimeError(f"rank {first} failed:\n{errors[first]}")
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        for jobs, p in zip(self._jobs, self._procs):
            if p.is_alive() and not self.broken:
                jobs.put(None)
        for p in self._procs:
            p.join(timeout=0.1 if self.broken else 10)
            if p.is_alive():
                p.kill()
        self._tmp.cleanup()
