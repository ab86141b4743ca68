"""What the tests, the demo and the GPU checks share: running a function on several ranks at once (``spawn``), and
the plain PyTorch code every op must equal (``plain``).

``spawn(fn, world_size, backend)`` starts ``world_size`` processes with ``torch.multiprocessing``, initialises a
process group through a ``file://`` store in a fresh temporary directory (never a fixed port), runs
``fn(rank, world_size, *args)`` in each, and raises in the parent if any rank failed, with that rank's traceback.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn: Callable, world_size: int, backend: str, init_file: str, env: dict, args: tuple, queue):
    os.environ.update(env)
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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="flashoverlap-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker, args=(rank, fn, world_size, backend, init_file, dict(env or {}), args, queue)
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
