"""Stand-ins for CUDA streams, stream memory operations and copy engines, so that the communicators' own code runs
on CPU tensors. ``install`` replaces parts of ``torch.cuda``: call it only in a child process."""

import contextlib
import ctypes
import time

import torch


class Stream:
    cuda_stream = 0

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, *args):
        return object()

    def synchronize(self):
        pass


def install(wait_timeout_s: float) -> None:
    """Streams become no-ops; a stream wait spins on the memory for up to ``wait_timeout_s`` (another thread-rank
    may still have to write it) and raises if the value never comes; stream writes and copies happen at once."""
    from flashoverlap.comm import stream_ops

    torch.cuda.Stream = lambda *a, **k: Stream()
    torch.cuda.current_stream = lambda *a, **k: Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.Tensor.record_stream = lambda self, stream: None

    def wait_geq(stream, address, value):
        start = time.time()
        while ctypes.c_int32.from_address(address).value < value:
            if time.time() - start > wait_timeout_s:
                raise RuntimeError("a stream wait was never satisfied")
            time.sleep(0)

    def write(stream, address, value):
        ctypes.c_int32.from_address(address).value = value

    def copy(stream, dst, src, nbytes):
        ctypes.memmove(dst, src, nbytes)

    stream_ops.wait_geq, stream_ops.write, stream_ops.copy = wait_geq, write, copy
