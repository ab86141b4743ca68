"""Replaying a call that repeats: one CUDA graph per call signature, so that a repeated call costs the host one
graph launch instead of the dozens of driver and cuBLAS calls that issuing its schedule takes.

A call's *signature* is everything its GPU work depends on apart from the values in the tensors: the plan, the
dtype, and the address and strides of every tensor it reads or writes (``P2PCommunicator.run``). A graph
captured for a signature computes on whatever those addresses hold when it is replayed, so a replay is exactly the
eager call. Inside a model the same layer's call sees the same addresses step after step (the caching allocator
hands them out in the same order), and so does a benchmark loop.

A signature is captured the second time it is seen: a call that never repeats pays no capture, and one that
repeats pays one (about an eager call's host time plus the graph's instantiation). The graphs share one memory pool
and one capture stream; at most ``capacity`` are kept, the least recently used dropped first, and a signature whose
graph was dropped is not captured again: where a model's calls have more signatures than that (a layer's call per
layer, each with its own weight), capturing again would cost a capture on every other call, milliseconds each, so
those calls are issued eagerly instead. Graphs of one communicator replay one after another, like the group's calls
themselves, so scratch memory that a graph frees inside its own capture may be reused by the next capture.

A call's independent work (a communicator's ``hook``) is held in its graph where it has a signature of its own
(``Matmul``: a backward's weight gradient); other hooks are arbitrary code, and their calls are issued eagerly.
Where replay is not used either (the runtime's verdict, ``Call.replay``; ``settings.py``): inside a user's
capture (the call is captured into the user's graph instead), in debug mode (``FLASHOVERLAP_DEBUG_TIMEOUT``: each
flag wait is polled with a deadline, which needs the eager schedule), with ``CUDA_DEVICE_MAX_CONNECTIONS=1``
(the deadlock argument of ``comm/tp/ring_schedule.py`` rests on the issue order of the streams' work, which a graph
launch does not keep on a single hardware queue), and with ``FLASHOVERLAP_REPLAY=0``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from flashoverlap.comm import stream_ops
from flashoverlap.comm.protocol import Call, HeldHook

CAPACITY = 256  # graphs kept per communicator: a deep model's layers each have their own signatures
CAPTURE_AFTER = 2  # calls of a signature before it is captured


def address(tensor: torch.Tensor | None) -> tuple | None:
    """What a captured call depends on of a tensor besides its values: where it is and how it is laid out."""
    return None if tensor is None else (tensor.data_ptr(), tensor.shape, tensor.stride())


_FP16_ACCUMULATION = getattr(torch._C, "_get_cublas_allow_fp16_accumulation", lambda: None)
_BLAS_BACKEND = getattr(torch._C, "_get_blas_preferred_backend", lambda: None)


def cublas_switches() -> tuple:
    """The switches that pick the kernels a captured half-precision matmul runs: cuBLAS's reduced-precision
    reductions (bf16, fp16; in newer torch with their split-K halves), fp16 accumulation and the preferred BLAS
    library. Part of a signature (float32 never takes a path that replays). Read through torch's C getters (the
    ``torch.backends.cuda.matmul`` attributes go through a Python ``__getattr__``)."""
    return (torch._C._get_cublas_allow_bf16_reduced_precision_reduction(),
            torch._C._get_cublas_allow_fp16_reduced_precision_reduction(), _FP16_ACCUMULATION(), _BLAS_BACKEND())


def allocate(shapes: tuple, device: torch.device) -> list[torch.Tensor]:
    """The tensors a call allocates and writes, of ``shapes`` (``(shape, dtype)`` pairs), in that order on every call,
    from the caching allocator (whose reuse of addresses is what lets a repeated call find its graph)."""
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]


def addresses(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> tuple:
    """Where each of a call's ``allocate``d tensors lies: ``signature``'s second part."""
    return tuple([t.data_ptr() for t in tensors])


def signature(inputs: tuple, outputs: tuple) -> tuple:
    """A call's signature in two parts, so that a repeated call's replay (``CallGraphs.replayer``) rebuilds only the
    second: ``inputs``, what the call reads (the plan, the operands' dtypes, addresses and layouts, a held hook's
    tensors, the fp8 scales; the communicator's own buffers where they may move), fixed by the call's tensors; and
    ``outputs``, the addresses of the tensors the call allocates and writes, allocated in one order on every call;
    with the cuBLAS switches read at the call."""
    return inputs, outputs, cublas_switches()


def gemm_call_inputs(call: Call) -> tuple:
    """What a tensor-parallel call's GPU work reads besides the tensors' values (``signature``'s first part): the
    plan, the dtypes, where each operand lies and how it is laid out, the held hook's tensors; an fp8 call's scales:
    their mode, the output dtype, and where the scales and the bias lie."""
    scales, hook = call.scales, call.hook
    return (call.plan, call.a.dtype, call.b.dtype, address(call.a), address(call.b),
            None if hook is None else hook.signature,
            None if scales is None else (scales.mode, scales.out_dtype, address(scales.a), address(scales.b),
                                         address(scales.bias)))


def gemm_call_signature(call: Call, buffers: tuple) -> tuple:
    """A tensor-parallel call's whole signature: ``gemm_call_inputs`` and the addresses of the buffers it writes
    (``buffers``, allocated in one order on every call)."""
    return signature(gemm_call_inputs(call), buffers)


class Matmul(HeldHook):
    """``out = x @ y`` on the current stream, as a call's independent work (a communicator's ``hook``: a backward
    pass's weight gradient) that a replayed call may hold, because its ``signature`` says what it depends on."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
        self.x, self.y, self.out = x, y, out

    def __call__(self) -> None:
        torch.mm(self.x, self.y, out=self.out)

    @property
    def signature(self) -> tuple:
        return address(self.x), address(self.y), address(self.out)


class CallGraphs:
    """The captured graphs of one communicator, by signature."""

    def __init__(self, device: torch.device, capacity: int = CAPACITY, capture_after: int = CAPTURE_AFTER,
                 capture: Callable[[Callable[[], None]], object] | None = None) -> None:
        self.device = device
        self.capacity = capacity
        self.capture_after = capture_after
        self._capture = capture or self._capture_cuda
        # signature -> [graph, its exec handle (None: replayed by torch), the use it was last replayed or captured
        # on]: a hit is one lookup (the least recently used is found only when a capture overflows the capacity)
        self._graphs: dict[Hashable, list] = {}
        self._seen: OrderedDict[Hashable, int] = OrderedDict()
        self._dropped: OrderedDict[Hashable, None] = OrderedDict()  # signatures whose graph was dropped for room
        self._uses = 0
        self._stream: torch.cuda.Stream | None = None
        self._pool = None
        self._launch = None  # (driver, device index): resolved on the first launch
        self.captures = 0
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def replay(self, signature: Hashable) -> bool:
        """Replay the graph of ``signature`` on the current stream, if one was captured (a repeated call's whole
        host work: one lookup and one launch). False: none; the caller goes on to ``run``."""
        entry = self._graphs.get(signature)
        if entry is None:
            return False
        self._uses += 1
        entry[2] = self._uses
        if entry[1] is None:
            entry[0].replay()
        else:
            if self._launch is None:
                self._launch = (stream_ops.fast(), self.device.index if self.device.index is not None
                                else torch.cuda.current_device())
            driver, index = self._launch
            driver.launch_graph(entry[1], driver.current_stream(index))
        self.replays += 1
        return True

    def run(self, signature: Hashable, issue: Callable[[], None]) -> bool:
        """Replay the graph of ``signature`` on the current stream, capturing ``issue()`` (which queues the call's
        work on the current stream and joins every other stream it uses back into it) into it first where this
        is the signature's ``capture_after``-th call. False: not replayed; the caller issues the call eagerly."""
        return self.replay(signature) or self.record(signature, issue)

    def record(self, signature: Hashable, issue: Callable[[], None]) -> bool:
        """``run`` for a signature that ``replay`` just found no graph for: count the call, and on its
        ``capture_after``-th capture ``issue()`` and replay it. False: not replayed."""
        if signature in self._dropped:  # dropped for room once: not captured again (see the module docstring)
            return False
        seen = self._seen.pop(signature, 0) + 1
        if seen < self.capture_after:
            self._seen[signature] = seen
            _trim(self._seen, 4 * self.capacity)
            return False
        graph = self._capture(issue)
        self.captures += 1
        # Launched through the driver where torch hands out the instantiated graph (host time: our graphs draw no
        # random numbers, so CUDAGraph.replay's other work does not apply); else replayed by torch.
        raw = getattr(graph, "raw_cuda_graph_exec", None)
        self._graphs[signature] = [graph, raw() if raw is not None else None, self._uses]
        if len(self._graphs) > self.capacity:
            oldest = min(self._graphs, key=lambda key: self._graphs[key][2])
            del self._graphs[oldest]
            self._dropped[oldest] = None
            _trim(self._dropped, 4 * self.capacity)
        return self.replay(signature)

    def replayer(self, inputs: tuple, allocate: Callable[[], tuple[tuple, object]],
                 result: Callable[[object], tuple]) -> Callable[[object], tuple | None]:
        """A repeated call's whole host work, for the runtime's replay lane (``runtime/calls.py``), built from one
        call and kept for the calls that read the same tensors (``inputs``: ``signature``'s first part): a function
        that allocates a call's outputs (``allocate() -> (their addresses, the buffers)``, in the order the call
        itself allocates them) and replays the graph captured for ``inputs`` and those outputs, then returns
        ``result(buffers)`` (the call's ``(result, extra)``, after the replay: it may copy out of them); None where
        no graph is held for them (the caller then runs the call, which captures or issues it). It takes the later
        call's spec (``comm/protocol.py``) and reads nothing of it, and holds no tensor of the call's."""
        replay = self.replay

        def again(spec: object = None) -> tuple | None:
            outputs, buffers = allocate()
            return result(buffers) if replay(signature(inputs, outputs)) else None

        return again

    def clear(self) -> None:
        """Drop every graph (the addresses they hold are no longer valid, e.g. the workspace was reallocated)."""
        self._graphs.clear()
        self._seen.clear()
        self._dropped.clear()
        self._pool = None
        self._launch = None

    def _capture_cuda(self, issue: Callable[[], None]) -> torch.cuda.CUDAGraph:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        graph = torch.cuda.CUDAGraph()
        # Thread-local: the NCCL watchdog's event queries on other threads must not invalidate the capture.
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                issue()
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass  # the capture was invalidated by the error being raised
                raise
            graph.capture_end()
        # Later captures share this graph's pool; it lives while any graph that uses it does (``clear`` forgets
        # it, and ``run`` captures before it drops the least recently used graph).
        self._pool = graph.pool()
        return graph


def _trim(entries: OrderedDict, limit: int) -> None:
    while len(entries) > limit:
        entries.popitem(last=False)
