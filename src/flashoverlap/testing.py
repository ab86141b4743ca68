"""What the tests, the demo and the GPU checks share: running a function on several ranks at once (``spawn``), and
the plain PyTorch code every op must equal (``plain``).

``spawn(fn, world_size, backend)`` starts ``world_size`` processes with ``torch.multiprocessing``, initialises a
process group through a ``file://`` store in a fresh temporary directory (never a fixed port), runs
``fn(rank, world_size, *args)`` in each, and raises in the parent if any rank failed, with that rank's traceback.

Where the platform has it, the ranks are forked from a ``forkserver`` that has imported torch and flashoverlap
once (``start_context``): a fresh interpreter per rank paid that import, seconds per rank on a CPU machine, in every
call. Each rank is still a new process (no state passes from one ``spawn`` to the next: the server only imports,
it never runs a rank's work or touches CUDA). The server keeps the environment it started with, so every rank is
handed the caller's ``os.environ`` as it is at the call, and applies it before anything else. Likewise the
server's stdout and stderr are not the caller's: each rank prints into files that are copied, once the ranks have
ended, onto the caller's own ``sys.stdout`` and ``sys.stderr`` (where a test runner captures them for the test).
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "flashoverlap"]
_START = None  # the context start_context() made, kept for the process


def start_context():
    """The start method of the ranks: ``forkserver`` preloading ``_PRELOAD`` where the platform has it, else
    ``spawn`` (both start ranks without the caller's CUDA state, which a forked CUDA context could not use)."""
    global _START
    if _START is None:
        if "forkserver" in mp.get_all_start_methods():
            _START = mp.get_context("forkserver")
            _START.set_forkserver_preload(_PRELOAD)
        else:
            _START = mp.get_context("spawn")
    return _START


def _worker(rank: int, fn: Callable, world_size: int, backend: str, init_file: str, env: dict, args: tuple, queue,
            output: str):
    os.environ.clear()  # the caller's environment at the call (env included), not the forkserver's
    os.environ.update(env)
    for fd, suffix in ((1, "out"), (2, "err")):  # the forkserver's stdout and stderr are not the caller's: to files
        log = os.open(f"{output}.{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, fd)
        os.close(log)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device_id = torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group(
                backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, device_id=device_id
            )
        else:
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()


def _relay(output: str, world_size: int) -> None:
    """What each rank printed, in rank order, on the caller's own stdout and stderr (where a test runner captures
    it for the test that spawned the ranks)."""
    for rank in range(world_size):
        for stream, suffix in ((sys.stdout, "out"), (sys.stderr, "err")):
            try:
                with open(f"{output}.{rank}.{suffix}", errors="replace") as f:
                    text = f.read()
            except FileNotFoundError:  # the rank died before it opened its files
                continue
            if text:
                stream.write(text)
        sys.stdout.flush()


def spawn(
    fn: Callable,
    world_size: int,
    backend: str = "gloo",
    args: tuple = (),
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result, in rank order.

    ``fn`` must be importable (a module-level function). ``env`` is applied in each child before the process group
    and any CUDA context exist (so e.g. ``CUDA_DEVICE_MAX_CONNECTIONS`` takes effect there).
    """
    ctx = start_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="flashoverlap-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        output = os.path.join(tmp, "rank")  # rank r prints into output.r.out and output.r.err
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, fn, world_size, backend, init_file, {**os.environ, **(env or {})}, args, queue, output),
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            for _ in range(world_size):
                rank, status, payload = queue.get(timeout=timeout)
                (results if status == "ok" else errors)[rank] = payload
        except Exception as exc:  # a rank died without reporting, or timed out
            for p in procs:
                p.kill()
            raise RuntimeError(f"spawn: ranks did not all report within {timeout} s: {exc!r}") from None
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
            _relay(output, world_size)
        if errors:
            first = min(errors)
            raise RuntimeError(f"rank {first} failed:\n{errors[first]}")
        return [results[r] for r in range(world_size)]


def plain(op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """What users run today, and the oracle every op is compared with: ``torch.matmul`` and then the collective
    (``op``: ``all_reduce``, ``reduce_scatter`` or ``all_gather``, whose ``a`` is this rank's shard), one after the
    other, through ``torch.distributed`` alone."""
    from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor

    world = dist.get_world_size(group)
    if op == "all_gather":
        full = torch.empty((a.shape[0] * world, a.shape[1]), dtype=a.dtype, device=a.device)
        all_gather_into_tensor(full, a.contiguous(), group)
        return torch.matmul(full, b)
    c = torch.matmul(a, b)
    if op == "all_reduce":
        dist.all_reduce(c, group=group)
        return c
    out = torch.empty((c.shape[0] // world, c.shape[1]), dtype=c.dtype, device=c.device)
    reduce_scatter_tensor(out, c, group)
    return out
