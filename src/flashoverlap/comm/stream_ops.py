"""CUDA stream memory operations that occupy no SM: waits and writes on a 32-bit word, and copy-engine copies.

``cuStreamWaitValue32`` blocks a stream (not the host, not any SM) until a word in device memory reaches a value;
``cuStreamWriteValue32`` writes a word when the stream reaches that point. Both are plain stream work, so they
are ordered with the stream's kernels and can be captured in a CUDA graph. Reached through ``cuda.bindings``,
imported on first use so that the CPU-only parts of the package never need it. Inside a graph a wait takes the
form of the wait kernel (``graph_waits``, ``counter_wait_kernel``, ``load_wait_kernel``: ``kernels/counters.py``),
for every executor that waits on counters or flags.
"""

from __future__ import annotations

import functools
import struct

import torch


@functools.cache
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 spelled it this way
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as exc:
            raise RuntimeError(
                "flashoverlap's NCCL path needs the cuda-bindings package for CUDA stream memory operations: "
                "pip install cuda-bindings (or, in a source checkout, pip install -e \".[gpu]\")"
            ) from exc
    return driver


def _check(result, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {err!r}")


def wait_geq(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Block ``stream`` until the int32 at device ``address`` is >= ``value`` (cyclic comparison)."""
    d = _driver()
    flags = int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    _check(d.cuStreamWaitValue32(stream.cuda_stream, address, value, flags), "cuStreamWaitValue32")


def write(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Write the int32 ``value`` to device ``address`` when ``stream`` reaches this point (``FastDriver.write``:
    a ``cuda.bindings`` call costs microseconds of argument conversion)."""
    fast().write(stream.cuda_stream, address, value)


def wait_reset(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Block ``stream`` until the int32 at device ``address`` is >= ``value``, then write 0 there (``wait_geq`` and
    ``write`` in one driver call: ``FastDriver.wait_reset``)."""
    fast().wait_reset(stream.cuda_stream, address, value)


def graph_waits(forced: str | None, device: torch.device) -> str:
    """How a flag wait captured into a CUDA graph is issued, the one rule of both P2P executors: ``forced``
    ("kernel" or "memop") where given, else the wait kernel on a GPU (``kernels/counters.py``: each memory operation
    captured into a graph is a node the driver prepares again at every launch) and memory operations elsewhere (the
    CPU tests' recording drivers). Eager calls always wait with memory operations."""
    if forced is not None:
        return forced
    return "kernel" if device.type == "cuda" else "memop"


def counter_wait_kernel(counters: torch.Tensor, index: int, value: int) -> None:
    """``kernels/counters.wait_reset`` on the current stream: a graph's wait on a counter or flag of ``counters``
    (the NCCL path's per-group counters, the P2P paths' flags; Triton: imported where a kernel runs)."""
    from flashoverlap.kernels.counters import wait_reset

    wait_reset(counters, index, value)


def load_wait_kernel(device: torch.device) -> None:
    """``kernels/counters.load``: the wait kernel compiled and loaded on ``device``, outside any capture (deadlock
    rule 3: a graph launches it behind a wait)."""
    from flashoverlap.kernels.counters import load

    load(device)


def join(waiter: int, source: int, event: int) -> None:
    """Work queued on stream ``waiter`` from now on waits for the work queued so far on stream ``source`` (raw
    handles), through the driver event ``event`` (``new_event``): ``Stream.wait_stream`` makes a torch event and goes
    through Python objects each time, this is two driver calls (inside a capture: the edge between the branches)."""
    driver = fast()
    driver.record(event, source)
    driver.wait_event(waiter, event)


def new_event() -> int:
    """A driver event for ``join`` (``FastDriver.new_event``), kept for the life of its owner."""
    return fast().new_event()


def current(index: int) -> int:
    """The raw handle of the current stream on device ``index`` (one C call)."""
    return fast().current_stream(index)


def copy(stream: torch.cuda.Stream, dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from device address ``src`` to ``dst`` on ``stream`` with ``cuMemcpyDtoDAsync``: a copy
    engine moves the bytes, no SM (unlike a copy kernel). Either address may be a peer's, mapped into this
    device's address space (symmetric memory)."""
    d = _driver()
    _check(d.cuMemcpyDtoDAsync(dst, src, nbytes, stream.cuda_stream), "cuMemcpyDtoDAsync")


# One CUstreamBatchMemOpParams (cuda.h): a 48-byte union whose wait/write member is the operation (uint32), the
# address (CUdeviceptr), the value (a union of uint32 and uint64), the flags (uint32) and an alias (driver's own).
_MEM_OP = struct.Struct("<I4xQQI4xQ8x")
_WAIT_RESET = struct.Struct("<" + 2 * _MEM_OP.format[1:])
_WAIT_VALUE_32, _WRITE_VALUE_32 = 1, 2  # CU_STREAM_MEM_OP_WAIT_VALUE_32, CU_STREAM_MEM_OP_WRITE_VALUE_32
MEMOPS_MAX = 128  # operations in one ``memops`` batch (the driver takes up to 256)


def pack_memops(ops) -> object:
    """``ops``, a sequence of ``("wait", address)`` (block the stream until the int32 there is >= 1, then write 0
    there: two operations, in that order, as ``FastDriver.wait_reset``) and ``("write", address, value)`` (write the
    int32 ``value``, after a memory fence, as ``FastDriver.write``), packed once into the CUstreamBatchMemOpParams
    array that ``FastDriver.memops`` hands to ``cuStreamBatchMemOp``: the stream runs them in this order. Returns
    a ctypes buffer whose ``count`` attribute is the number of driver operations in it (at most ``MEMOPS_MAX``)."""
    import ctypes

    fields: list[tuple[int, int, int]] = []
    for op in ops:
        if op[0] == "wait":
            fields += [(_WAIT_VALUE_32, op[1], 1), (_WRITE_VALUE_32, op[1], 0)]
        elif op[0] == "write":
            fields.append((_WRITE_VALUE_32, op[1], op[2]))
        else:
            raise ValueError(f"unknown stream memory operation {op[0]!r}")
    if not 0 < len(fields) <= MEMOPS_MAX:
        raise ValueError(f"a batch holds 1 to {MEMOPS_MAX} stream memory operations, got {len(fields)}")
    buffer = ctypes.create_string_buffer(len(fields) * _MEM_OP.size)
    for i, (operation, address, value) in enumerate(fields):
        _MEM_OP.pack_into(buffer, i * _MEM_OP.size, operation, address, value, 0, 0)
    buffer.count = len(fields)
    return buffer


def unpack_memops(buffer, count: int) -> list[tuple[str, int, int]]:
    """``pack_memops``'s driver operations read back, in order: ``("wait", address, value)`` (>= value) and
    ``("write", address, value)`` (for tests and recording drivers)."""
    names = {_WAIT_VALUE_32: "wait", _WRITE_VALUE_32: "write"}
    out = []
    for i in range(count):
        operation, address, value, flags, _ = _MEM_OP.unpack_from(bytes(buffer), i * _MEM_OP.size)
        if operation not in names or flags:
            raise ValueError(f"operation {i}: not a wait for >= value or a fenced write ({operation}, {flags:#x})")
        out.append((names[operation], address, value))
    return out


# One CUmemcpyAttributes (CUDA >= 12.8): the source access order (CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1), the source
# and destination location hints (a CUmemLocation each: type, id; 0, 0 is no hint, for device memory) and flags.
_COPY_ATTRIBUTES = struct.Struct("<IiiiiI")
_SRC_ACCESS_ORDER_STREAM = 1


class CopyBatch:
    """The arrays of one batch of ``count`` device-to-device copies for ``FastDriver.copies``
    (``cuMemcpyBatchAsync``): ``dsts``, ``srcs`` (addresses) and ``sizes`` (bytes), filled by the caller, which may
    rewrite an address before each use (the arrays are read during the driver call, not later); one set of
    attributes for all (stream-ordered sources, no location hints). The copies of a batch may run in any order or
    at once: they must not overlap, and none may read what another writes."""

    def __init__(self, count: int) -> None:
        import ctypes

        if count < 1:
            raise ValueError(f"a copy batch holds at least one copy, got {count}")
        self.count = count
        self.dsts = (ctypes.c_uint64 * count)()
        self.srcs = (ctypes.c_uint64 * count)()
        self.sizes = (ctypes.c_size_t * count)()
        self.attributes = ctypes.create_string_buffer(_COPY_ATTRIBUTES.pack(_SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0),
                                                      _COPY_ATTRIBUTES.size)
        self.first = (ctypes.c_size_t * 1)(0)  # the attributes apply from copy 0 on
        self.failed = ctypes.c_size_t(0)


class FastDriver:
    """The P2P path's operations (a write, a copy, a wait with its reset, an event recorded on one stream and
    waited for on another) through ``ctypes`` straight into ``libcuda``, for its hot loop: a ``cuda.bindings``
    call costs several microseconds of argument conversion, ``torch.cuda.Event.record``, ``Stream.wait_event``
    and ``torch.cuda.current_stream`` cost several more through Python objects, and one call of a ring schedule
    issues dozens of them. Raw stream and event handles and device addresses; every result is checked."""

    def __init__(self) -> None:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")

        def bind(names, *argtypes):
            for name in names:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
                    return fn
            raise RuntimeError(f"libcuda has none of {names}")

        u64, u32, ptr = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
        self._write = bind(("cuStreamWriteValue32_v2", "cuStreamWriteValue32"), ptr, u64, u32, ctypes.c_uint)
        self._copy = bind(("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"), u64, u64, ctypes.c_size_t, ptr)
        self._batch = bind(("cuStreamBatchMemOp_v2", "cuStreamBatchMemOp"), ptr, ctypes.c_uint, ptr, ctypes.c_uint)
        self._event_create = bind(("cuEventCreate",), ptr, ctypes.c_uint)
        self._event_destroy = bind(("cuEventDestroy_v2", "cuEventDestroy"), ptr)
        self._event_record = bind(("cuEventRecord",), ptr, ptr)
        self._stream_wait_event = bind(("cuStreamWaitEvent",), ptr, ptr, ctypes.c_uint)
        self._graph_launch = bind(("cuGraphLaunch",), ptr, ptr)
        # cuMemcpyBatchAsync (a driver of CUDA >= 12.8), by version through cuGetProcAddress: CUDA 13.0's takes no
        # failure index, 12.8's does. None where the driver has neither: ``copies`` is then None, and the caller
        # issues its copies one by one.
        self._copy_batch, self._copy_batch_fails = self._batch_copy_entry(lib)
        self.copies = self._copies if self._copy_batch is not None else None
        self._pair = ctypes.create_string_buffer(2 * _MEM_OP.size)  # reused: the driver reads it during the call
        self._handle = ctypes.c_void_p()
        self._ref = ctypes.byref(self._handle)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch; one C call
        self.current_stream = raw if raw is not None else (
            lambda index: torch.cuda.current_stream(index).cuda_stream)

    def write(self, stream: int, address: int, value: int) -> None:
        if self._write(stream, address, value, 0):  # CU_STREAM_WRITE_VALUE_DEFAULT: after a memory fence
            raise RuntimeError(f"cuStreamWriteValue32 failed (address {address:#x})")

    def wait_reset(self, stream: int, address: int, value: int = 1) -> None:
        """Block ``stream`` until the int32 at ``address`` is >= ``value`` (cyclic comparison), then write 0 there:
        one batch of two stream memory operations, run in order (one driver call, and one graph node when
        captured)."""
        _WAIT_RESET.pack_into(self._pair, 0, _WAIT_VALUE_32, address, value, 0, 0, _WRITE_VALUE_32, address, 0, 0,
                              0)
        if self._batch(stream, 2, self._pair, 0):
            raise RuntimeError(f"cuStreamBatchMemOp failed (wait and reset of {address:#x})")

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        if self._copy(dst, src, nbytes, stream):
            raise RuntimeError(f"cuMemcpyDtoDAsync failed ({nbytes} bytes, {src:#x} -> {dst:#x})")

    def memops(self, stream: int, batch) -> None:
        """The stream memory operations of ``batch`` (``pack_memops``) on ``stream``, in order, in one
        ``cuStreamBatchMemOp`` (one driver call, for waits and writes that would each be one)."""
        if self._batch(stream, batch.count, batch, 0):
            raise RuntimeError(f"cuStreamBatchMemOp failed ({batch.count} operations: "
                               f"{unpack_memops(batch, batch.count)})")

    @staticmethod
    def _batch_copy_entry(lib):
        """(cuMemcpyBatchAsync, whether it takes a failure index), or (None, False) where the driver lacks it."""
        import ctypes

        get, driver_version = getattr(lib, "cuGetProcAddress_v2", None), getattr(lib, "cuDriverGetVersion", None)
        if get is None or driver_version is None:
            return None, False
        version = ctypes.c_int(0)
        driver_version.argtypes, driver_version.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        if driver_version(ctypes.byref(version)) or version.value < 12080:
            return None, False
        # The ABI asked for is the driver's own: a 12.x driver answers a request for 13.0 with its 12.8 entry point.
        asked, fails = (13000, False) if version.value >= 13000 else (12080, True)
        u64, ptr, size = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ptr), ctypes.c_int, u64, ctypes.POINTER(ctypes.c_int)]
        get.restype = ctypes.c_int
        fn, found = ptr(), ctypes.c_int(-1)
        # flags CU_GET_PROC_ADDRESS_DEFAULT; found: CU_GET_PROC_ADDRESS_SUCCESS (0)
        if get(b"cuMemcpyBatchAsync", ctypes.byref(fn), asked, 0, ctypes.byref(found)) or found.value or not fn.value:
            return None, False
        arrays = [ptr, ptr, ptr, size, ptr, ptr, size]  # dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *arrays, *([ptr] if fails else []), ptr)  # [failIdx,] hStream
        return proto(fn.value), fails

    def _copies(self, stream: int, batch: CopyBatch) -> None:
        """The copies of ``batch`` on ``stream`` in one ``cuMemcpyBatchAsync`` (``copies``: None where the driver
        has none)."""
        import ctypes

        args = (batch.dsts, batch.srcs, batch.sizes, batch.count, batch.attributes, batch.first, 1)
        if self._copy_batch_fails:
            err = self._copy_batch(*args, ctypes.byref(batch.failed), stream)
        else:
            err = self._copy_batch(*args, stream)
        if err:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUDA driver error {err} ({batch.count} copies: "
                               f"{[(hex(s), hex(d), n) for s, d, n in zip(batch.srcs, batch.dsts, batch.sizes)]})")

    def new_event(self) -> int:
        """A driver event without timing (``CU_EVENT_DISABLE_TIMING``), for ordering streams; the caller frees it
        with ``free_event``."""
        if self._event_create(self._ref, 0x2):
            raise RuntimeError("cuEventCreate failed")
        return self._handle.value

    def free_event(self, event: int) -> None:
        if self._event_destroy(event):
            raise RuntimeError(f"cuEventDestroy failed (event {event:#x})")

    def record(self, event: int, stream: int) -> None:
        """``event`` marks the work queued so far on ``stream`` (inside a capture: a dependency of the graph)."""
        if self._event_record(event, stream):
            raise RuntimeError(f"cuEventRecord failed (event {event:#x}, stream {stream:#x})")

    def launch_graph(self, graph_exec: int, stream: int) -> None:
        """Launch an instantiated CUDA graph (``torch.cuda.CUDAGraph.raw_cuda_graph_exec()``) on ``stream``: what
        ``CUDAGraph.replay`` does for a graph that draws no random numbers, without its Python and C++ layers."""
        if self._graph_launch(graph_exec, stream):
            raise RuntimeError(f"cuGraphLaunch failed (graph {graph_exec:#x}, stream {stream:#x})")

    def wait_event(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now on waits for ``event``'s last record."""
        if self._stream_wait_event(stream, event, 0):
            raise RuntimeError(f"cuStreamWaitEvent failed (stream {stream:#x}, event {event:#x})")


@functools.cache
def fast() -> FastDriver:
    return FastDriver()
