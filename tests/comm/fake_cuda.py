"""Stand-ins for CUDA streams, events, stream memory operations and copy engines, so that the communicators' own
code runs on CPU tensors, with the producer asynchronous as on a GPU. ``install`` replaces parts of
``torch.cuda``: call it only in a child process.

The communicator's stream work runs on the host thread as it is issued (a stream wait blocks the host until the
word is written or ``wait_timeout_s`` passes, then raises); the producer that a real GPU would run beside it (the
GEMM's tiles and counters, cuBLAS bands and their events) runs in a ``Producer`` thread, slowly, tile by tile. An
operation issued before the data it needs is complete therefore reads unfinished data, and a wait that is never
satisfied raises instead of hanging."""

import contextlib
import ctypes
import threading
import time

import torch


class Event:
    """A CUDA event whose completion the producer thread sets."""

    def __init__(self):
        self.done = threading.Event()

    def query(self):
        return self.done.is_set()


class Stream:
    cuda_stream = 0
    timeout_s = 5.0

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        if isinstance(event, Event) and not event.done.wait(self.timeout_s):
            raise RuntimeError("a stream waited for an event that never completed")

    def record_event(self, *args):
        event = Event()
        event.done.set()  # the host-side streams' work is complete when it is issued
        return event

    def synchronize(self):
        pass


class Producer(threading.Thread):
    """Runs ``steps`` (callables) one after another, ``delay_s`` apart, like a GEMM finishing tiles."""

    def __init__(self, steps, delay_s=0.01):
        super().__init__(daemon=True)
        self.steps, self.delay_s = steps, delay_s

    def run(self):
        for step in self.steps:
            time.sleep(self.delay_s)
            step()


def install(wait_timeout_s: float) -> None:
    """Streams run their work on the host as it is issued; a stream wait spins on the memory for up to
    ``wait_timeout_s`` (the producer thread may still have to write it) and raises if the value never comes."""
    from flashoverlap.comm import stream_ops

    Stream.timeout_s = wait_timeout_s
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
            time.sleep(0.0005)

    def write(stream, address, value):
        ctypes.c_int32.from_address(address).value = value

    def copy(stream, dst, src, nbytes):
        ctypes.memmove(dst, src, nbytes)

    def wait_reset(stream, address, value):
        wait_geq(stream, address, value)
        write(stream, address, 0)

    stream_ops.wait_geq, stream_ops.write, stream_ops.copy = wait_geq, write, copy
    stream_ops.wait_reset = wait_reset
    # The host-side streams run their work as it is issued: joining them orders nothing more.
    stream_ops.join = lambda waiter, source, event: None
    stream_ops.new_event = lambda: 0
    stream_ops.current = lambda index: 0
