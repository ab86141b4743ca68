"""A process group's own NCCL communicator, called straight through ``ctypes``: the NCCL path's per-group collectives
at a few microseconds of host time each.

``torch.distributed``'s collective goes through its Python function and then ``ProcessGroupNCCL``'s C++ (a work
object, two CUDA events, stream guards, the flight recorder): about 30 µs of host time a collective on the H200
machines (``benchmarks/diagnostics/nccl_host_parts.py``), and an eager NCCL-path call issues one per group. The
collective itself is one ``ncclAllReduce`` / ``ncclReduceScatter`` / ``ncclAllGather`` on the group's communicator
(``ProcessGroupNCCL._comm_ptr()``) and the caller's stream: the same NCCL call, in the same order on every rank, on
the same communicator, so it matches the peers' calls whichever way each rank issued them. It is captured into CUDA
graphs as ``torch.distributed``'s is.

What it does not do: torch's watchdog does not see these calls (a hang in one is not turned into a timeout by
``TORCH_NCCL_ASYNC_ERROR_HANDLING``: the debug deadline of ``FLASHOVERLAP_DEBUG_TIMEOUT`` bounds the counter waits
before them), and ``TORCH_NCCL_*`` tracing does not record them. ``for_group`` returns None (the caller then uses
``torch.distributed``) wherever the binding cannot apply: no ``_comm_ptr`` in this torch, the communicator not made
yet, no ``libnccl`` loaded in the process, or a dtype NCCL lacks.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.distributed as dist

# ncclDataType_t and ncclRedOp_t (nccl.h)
_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
           torch.float64: 8, torch.bfloat16: 9}
_SUM = 0


@functools.cache
def _library():
    """The ``libnccl`` that torch loaded into this process (the one whose communicators ``_comm_ptr`` returns), or
    None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libnccl.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            for name in ("ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclGetErrorString"):
                getattr(lib, name)
        except (OSError, AttributeError):
            continue
        ptr, size = ctypes.c_void_p, ctypes.c_size_t
        lib.ncclAllReduce.argtypes = [ptr, ptr, size, ctypes.c_int, ctypes.c_int, ptr, ptr]
        lib.ncclReduceScatter.argtypes = [ptr, ptr, size, ctypes.c_int, ctypes.c_int, ptr, ptr]
        lib.ncclAllGather.argtypes = [ptr, ptr, size, ctypes.c_int, ptr, ptr]
        for fn in (lib.ncclAllReduce, lib.ncclReduceScatter, lib.ncclAllGather):
            fn.restype = ctypes.c_int
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        return lib
    return None


class NcclComm:
    """One process group's NCCL communicator: sum all-reduce, sum reduce-scatter and all-gather of dense tensors on
    a raw CUDA stream handle, as ``torch.distributed``'s blocking collectives compute them."""

    def __init__(self, lib, comm: int, world_size: int) -> None:
        self._lib, self._comm, self.world_size = lib, comm, world_size

    def all_reduce(self, tensor: torch.Tensor, stream: int) -> None:
        self.all_reduce_at(tensor.data_ptr(), tensor.numel(), _DTYPES[tensor.dtype], stream)

    def all_reduce_at(self, ptr: int, count: int, code: int, stream: int) -> None:
        """``all_reduce`` by address: the sum over the ranks of ``count`` elements of NCCL type ``code`` at ``ptr``,
        in place."""
        self._check(self._lib.ncclAllReduce(ptr, ptr, count, code, _SUM, self._comm, stream), "ncclAllReduce")

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, stream: int) -> None:
        self.reduce_scatter_at(out.data_ptr(), inp.data_ptr(), out.numel(), _DTYPES[out.dtype], stream)

    def reduce_scatter_at(self, out: int, inp: int, count: int, code: int, stream: int) -> None:
        """``reduce_scatter`` by address: ``count`` elements of NCCL type ``code`` at ``out``, this rank's block of the
        sum over the ranks of ``world_size * count`` elements at ``inp``."""
        self._check(self._lib.ncclReduceScatter(inp, out, count, code, _SUM, self._comm, stream),
                    "ncclReduceScatter")

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, stream: int) -> None:
        self.all_gather_at(out.data_ptr(), inp.data_ptr(), inp.numel(), _DTYPES[inp.dtype], stream)

    def all_gather_at(self, out: int, inp: int, count: int, code: int, stream: int) -> None:
        """``all_gather`` by address: ``count`` elements of NCCL type ``code`` (``code(dtype)``) from ``inp``, every
        rank's in rank order at ``out``."""
        self._check(self._lib.ncclAllGather(inp, out, count, code, self._comm, stream), "ncclAllGather")

    @staticmethod
    def code(dtype: torch.dtype) -> int:
        """NCCL's type for ``dtype`` (one ``takes``)."""
        return _DTYPES[dtype]

    def takes(self, dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def _check(self, result: int, what: str) -> None:
        if result != 0:  # 7 (ncclInProgress) does not arise: torch's communicators are blocking ones
            raise RuntimeError(f"flashoverlap: {what} failed: NCCL error {result} "
                               f"({self._lib.ncclGetErrorString(result).decode(errors='replace')})")


def for_group(group: dist.ProcessGroup, device: torch.device, enabled: bool = True) -> NcclComm | None:
    """``group``'s NCCL communicator on ``device``, called directly (see the module docstring), or None where that
    cannot apply. Call it after the group has run a collective on ``device`` (NCCL communicators are made on the
    first one)."""
    if not enabled or device.type != "cuda":
        return None
    try:
        backend = group._get_backend(device)
        comm = backend._comm_ptr()
    except (AttributeError, RuntimeError, ValueError):
        return None
    lib = _library() if comm else None
    if lib is None:
        return None
    return NcclComm(lib, int(comm), dist.get_world_size(group))
