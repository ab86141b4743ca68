"""What the tests, the demo and the GPU checks share: running a function on several ranks at once (``spawn``), and
the plain PyTorch code every op must equal (``plain``).

``spawn(fn, world_size, backend)`` (``spawn_on_one_gpu``: every rank on one GPU) starts ``world_size`` processes
with ``torch.multiprocessing``, initialises a
process group through a ``file://`` store in a fresh temporary directory (never a fixed port), runs
``fn(rank, world_size, *args)`` in each, and raises in the parent if any rank failed, with that rank's traceback.

On Linux the ranks are forked from a ``forkserver`` that imported torch and flashoverlap once (``rank_context``): a
fresh interpreter per rank paid that import, seconds per rank on a CPU machine, at every call. Each rank is still a
new process (nothing passes from one call to the next: the server only imports; it never runs a rank's work or
touches CUDA). What differs from fresh interpreters, and how it is handled:

- The server keeps the environment it started with: each rank is handed the caller's ``os.environ`` as it is at the
  call (``env`` on top) and takes it as its own before anything else (``apply_environ``). A variable read when torch
  is imported (``OMP_NUM_THREADS``, ``TORCH_LOGS``, ...) would come too late that way: a call whose environment
  differs from the server's in anything but the variables read only once work runs (``READ_AT_WORK``: flashoverlap's,
  NCCL's, CUDA's, pytest's, inductor's) starts its ranks in fresh interpreters.
- Forked ranks share the server's string-hash salt, where separate machines' processes do not: ``fresh=True`` starts
  fresh interpreters, for tests of what ranks must agree on.
- The server's stdout and stderr are not the caller's: each rank prints into files that are copied onto the
  caller's own ``sys.stdout`` and ``sys.stderr`` while the call waits (where a test runner captures them).

A rank that fails makes the call raise with its traceback once the others have reported or had ``FAILURE_GRACE``
seconds to: the first failure seen (a peer whose collective broke off because of it fails after it; the others'
last lines follow); a rank that ends without reporting, at once; a call not done within ``timeout``, then, naming
the ranks that did not report. Results travel pickled as bytes (a tensor's storage is not shared with the caller:
a rank may be gone before the caller reads it); one that cannot be pickled is that rank's failure.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_module
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torch._dynamo: the first autograd call of a custom op imports it (seconds a rank, for most tests of the layers).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "flashoverlap"]
# Environment variables read only once a rank runs its work, never while torch or flashoverlap is imported, and the
# two that torch.compile's inductor sets in the process that compiles (its other ``TORCHINDUCTOR_`` variables are
# read when the forkserver's preload imports ``torch._dynamo``: a change of one needs fresh interpreters).
READ_AT_WORK = ("FLASHOVERLAP_", "NCCL_", "TORCH_NCCL_", "CUDA_", "PYTEST_", "TORCHINDUCTOR_CACHE_DIR",
                "_TORCHINDUCTOR_")
FAILURE_GRACE = 20.0  # seconds the other ranks get to report once one has failed (they may wait for it)
_POLL = 0.2  # seconds between looks at the ranks (their output relayed, an ended rank noticed)
_server: tuple | None = None  # (the forkserver context, the environment the server started with), once started
_fresh_because: set[str] = set()  # variables that sent a call to fresh interpreters (``fresh_because``)


def rank_context(environ: dict | None = None, fresh: bool = False):
    """The start method for ranks that will run with ``environ`` (default: this process's): the forkserver (Linux;
    started at the first call, with this process's environment then) unless ``fresh`` or ``environ`` differs from
    the server's in a variable outside ``READ_AT_WORK``; else ``spawn``. Both start ranks without the caller's CUDA
    state, which a forked CUDA context could not use."""
    global _server
    if fresh or sys.platform != "linux" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    if _server is None:
        from multiprocessing import forkserver

        context = mp.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        forkserver.ensure_running()
        _server = (context, dict(os.environ))
    context, server_environ = _server
    environ = os.environ if environ is None else environ
    differ = (environ.keys() ^ server_environ.keys()) | {
        name for name in environ.keys() & server_environ.keys() if environ[name] != server_environ[name]}
    read_at_import = {name for name in differ if not name.startswith(READ_AT_WORK)}
    if read_at_import:
        _fresh_because.update(read_at_import)
        return mp.get_context("spawn")
    return context


def fresh_because() -> list[str]:
    """The variables whose change, in this process, sent a call's ranks to fresh interpreters (slower, not wrong)."""
    return sorted(_fresh_because)


def apply_environ(environ: dict, target: MutableMapping[str, str] = os.environ) -> None:
    """Make ``target`` (a rank's ``os.environ``) exactly ``environ``: the caller's variables, not the forkserver's."""
    target.clear()
    target.update(environ)


@contextlib.contextmanager
def _environment(environ: dict):
    """``os.environ`` is ``environ`` inside (the environment a fresh interpreter starts with), as it was after."""
    saved = dict(os.environ)
    try:
        apply_environ(environ)  # inside: a value os.environ refuses must not leave it half replaced
        yield
    finally:
        apply_environ(saved)


def _worker(rank: int, fn: Callable, job: tuple, queue, output: str):
    """Rank ``rank`` of ``job`` = ``(world_size, backend, init_file, env, args, one_gpu)``: set up, run ``fn``,
    report."""
    world_size, backend, init_file, env, args, one_gpu = job
    try:
        apply_environ(env)
        for fd, suffix in ((1, "out"), (2, "err")):  # the server's stdout and stderr are not the caller's: to files
            log = os.open(f"{output}.{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, fd)
            os.close(log)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device_id = torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group(
                backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, device_id=device_id
            )
        else:
            if one_gpu:
                torch.cuda.set_device(0)  # every rank on the GPU the caller sees first
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        # Every rank past the group's set-up before any runs fn: gloo's connection of a pair is not over for one
        # rank when the other returns from it, and a rank that then ends (fn raised at once, or ran no collective)
        # fails the other's set-up with "connection closed by peer" instead of reporting its own result.
        dist.barrier()
        result = fn(rank, world_size, *args)
        try:
            # As bytes: the queue's own pickler shares a tensor's storage with the parent through this process,
            # which may be gone before the parent reads it (results of a million elements failed that way).
            sent = pickle.dumps(result)
        except Exception as exc:  # noqa: BLE001  (reported as this rank's failure)
            raise RuntimeError(f"spawn: rank {rank}'s result ({type(result).__name__}) cannot be sent to the caller "
                               f"(pickled): {type(exc).__name__}: {exc}") from exc
        queue.put((rank, "ok", sent))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()


def _relay(output: str, world_size: int, offsets: dict) -> None:
    """What each rank printed since the last look (``offsets``: bytes already copied, per file), in rank order, onto
    the caller's own stdout and stderr."""
    for rank in range(world_size):
        for stream, suffix in ((sys.stdout, "out"), (sys.stderr, "err")):
            path = f"{output}.{rank}.{suffix}"
            try:
                with open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    data = f.read()
            except FileNotFoundError:  # not opened yet, or the rank ended before it opened it
                continue
            if data:
                offsets[path] = offsets.get(path, 0) + len(data)
                stream.write(data.decode(errors="replace"))
                stream.flush()


def spawn(
    fn: Callable,
    world_size: int,
    backend: str = "gloo",
    args: tuple = (),
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    fresh: bool = False,
    grace: float = FAILURE_GRACE,
    one_gpu: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result, in rank order.

    ``fn`` must be importable (a module-level function). ``env`` is applied in each child before the process group
    and any CUDA context exist (so e.g. ``CUDA_DEVICE_MAX_CONNECTIONS`` takes effect there). ``fresh``: every rank a
    new interpreter (its own string-hash salt, as on separate machines), not a fork of the preloaded server.
    ``grace``: seconds the other ranks get to report once one has failed. ``one_gpu``: every rank on the current
    GPU (``spawn_on_one_gpu``), over a gloo group.
    """
    if one_gpu and backend != "gloo":
        raise ValueError(f"spawn: one_gpu=True runs the ranks over a gloo group (NCCL refuses two ranks on one GPU), "
                         f"got backend={backend!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"spawn: world_size must be an int >= 1, got {world_size!r}")
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"spawn: env maps names to str values (to unset a variable, leave it out of env and "
                            f"del os.environ[name] in fn), got {name!r}: {value!r}")
    gpus = torch.cuda.device_count() if backend == "nccl" else 0
    if backend == "nccl" and gpus < 1:
        raise RuntimeError("spawn: backend='nccl' needs a CUDA GPU per rank (torch.cuda.device_count() is 0); "
                           "use backend='gloo' on the CPU")
    if backend == "nccl" and gpus < world_size:  # NCCL refuses two ranks on one GPU, deep inside its first call
        raise RuntimeError(f"spawn: backend='nccl' needs a CUDA GPU per rank: {world_size} ranks, "
                           f"{gpus} GPU{'s' if gpus > 1 else ''} (torch.cuda.device_count()); ask for at most "
                           f"{gpus} ranks, or spawn_on_one_gpu for ranks sharing one GPU over gloo")
    environ = {**os.environ, **(env or {})}
    ctx = rank_context(environ, fresh)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="flashoverlap-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        output = os.path.join(tmp, "rank")  # rank r prints into output.r.out and output.r.err
        job = (world_size, backend, init_file, environ, args, one_gpu)
        procs = [ctx.Process(target=_worker, args=(rank, fn, job, queue, output)) for rank in range(world_size)]
        with _environment(environ):  # a fresh interpreter starts with it: what torch reads at import time
            for p in procs:
                p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}  # in the order the failures were seen: the first is the likeliest cause
        offsets: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < world_size:
                try:
                    rank, status, payload = queue.get(timeout=_POLL)
                except queue_module.Empty:
                    _relay(output, world_size, offsets)
                    if time.monotonic() > deadline:
                        if errors:
                            break  # the grace is over: the failures seen are raised below
                        missing = [r for r in range(world_size) if r not in results]
                        for p in procs:
                            p.kill()
                        raise RuntimeError(f"spawn: ranks did not all report within {timeout} s: rank"
                                           f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did "
                                           "not") from None
                    ended = [r for r, p in enumerate(procs) if r not in results and r not in errors
                             and not p.is_alive()]
                    if ended and queue.empty():
                        time.sleep(_POLL)  # a report sent just before the rank ended may still be on its way
                        if queue.empty():
                            if not errors:  # the first failure: at once (a dead rank leaves its peers waiting)
                                for p in procs:
                                    p.kill()
                                raise RuntimeError(f"spawn: rank {ended[0]} ended (exit code "
                                                   f"{procs[ended[0]].exitcode}) without reporting") from None
                            for r in ended:
                                errors[r] = f"ended (exit code {procs[r].exitcode}) without reporting"
                    continue
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
                    deadline = min(deadline, time.monotonic() + grace)
        finally:
            for p in procs:  # ranks that reported get until the deadline (at least 1 s, at most 60 s) to end
                p.join(timeout=0.1 if errors or len(results) < world_size
                       else max(1.0, min(60.0, deadline - time.monotonic())))
                if p.is_alive():
                    p.kill()
                    p.join()
            _relay(output, world_size, offsets)
        if errors:
            first, *then = errors  # the first failure seen: a peer's own error (a collective broken off) comes after
            after = "".join(f"\nthen rank {r} failed: {errors[r].strip().splitlines()[-1]}" for r in then)
            raise RuntimeError(f"rank {first} failed:\n{errors[first]}{after}")
        return [results[r] for r in range(world_size)]


# The text of the warning torch raises for each synchronising call under set_sync_debug_mode("warn") (setting the
# mode raises a notice of its own, "... does not yet detect all synchronizing operations", which is not one).
SYNC_WARNING = "called a synchronizing CUDA operation"


def host_synchronisations(fn: Callable[[], object]) -> list[str]:
    """Where each synchronising CUDA call of one call of ``fn`` is issued (``torch.cuda.set_sync_debug_mode``: a
    device-to-host read, ``.item()``, ``.tolist()``, a stream or device synchronisation; not ``torch.distributed``'s
    collectives, which it does not see), as the innermost three frames outside torch and the warnings machinery,
    innermost first. Each is a wait for the host; a bounded-mode MoE layer promises none. The caller's sync debug
    mode is restored afterwards, and ``fn``'s other warnings go on to the handler in place before. Needs a CUDA
    build of torch (a RuntimeError says so on a CPU build)."""
    if not torch.cuda.is_available():
        raise RuntimeError("host_synchronisations: needs CUDA (torch.cuda.is_available() is False): it watches CUDA "
                           "synchronisations")
    import warnings

    found: list[str] = []
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            shown(message, category, filename, lineno, file, line)
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(torch_dir)
                  and os.path.basename(f.filename) not in ("warnings.py", "_py_warnings.py")]
        found.append(" <- ".join(f"{f.name}:{f.lineno}" for f in reversed(frames[-3:])))

    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return found


def spawn_on_one_gpu(fn: Callable, world_size: int, args: tuple = (), env: dict[str, str] | None = None,
                     timeout: float = 600.0) -> list[Any]:
    """``spawn`` with every rank on one GPU (the first the caller sees), over a gloo group: up to 8 processes run
    the P2P paths (tensor-parallel and expert) through the public ops, their peers' buffers mapped by CUDA IPC, so
    that tensor-parallel code can be tested at W = 8 on one GPU. Mechanics only: the ranks share the GPU's SMs and
    copy engines, so nothing timed here says anything about speed. ``path="auto"`` takes the P2P path on such a
    group; the NCCL path and the sequential plan need NCCL, which refuses two ranks on one GPU (a clear error)."""
    from flashoverlap.plan import P2P_MAX_RANKS

    if not torch.cuda.is_available():
        raise RuntimeError("spawn_on_one_gpu: needs a CUDA GPU (torch.cuda.is_available() is False)")
    if isinstance(world_size, int) and world_size > P2P_MAX_RANKS:  # the ops' P2P path, the one such ranks can run
        raise ValueError(f"spawn_on_one_gpu: up to {P2P_MAX_RANKS} ranks (the P2P path's most), got {world_size}")
    return spawn(fn, world_size, "gloo", args=args, env=env, timeout=timeout, one_gpu=True)


def plain(op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """What users run today, and the oracle every op is compared with: ``torch.matmul`` and then the collective
    (``op``: ``all_reduce``, ``reduce_scatter`` or ``all_gather``, whose ``a`` is this rank's shard), one after the
    other, through ``torch.distributed`` alone."""
    from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
    from flashoverlap.plan import OPS

    if op not in OPS:
        raise ValueError(f"plain: op must be 'all_reduce', 'reduce_scatter' or 'all_gather', got {op!r}")
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
