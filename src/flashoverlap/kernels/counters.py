"""A counter wait as a kernel: the form a call's per-group wait (NCCL path) and per-flag wait (both P2P paths,
``comm/tp/p2p.py`` and ``comm/expert/p2p.py``: a flag of 0 or 1, waited for 1) takes inside a CUDA graph.

Eagerly a stream waits on a group's counter with a stream memory operation (``comm/stream_ops.wait_reset``), which
occupies no SM. Captured into a graph, each such operation becomes a node that the driver prepares again on every
launch of the graph: about 2 µs of host time each, where a kernel node costs a few hundredths
(``benchmarks/diagnostics/graph_launch.py``; ``benchmarks/results/logs/graph-launch-*.json``). So in a graph the
wait is this kernel: one program of one warp spins with acquire loads until the counter reaches the value, then
resets it to 0, as the memory operation does.

It takes one warp of one SM while it spins. That never blocks its producer: the signalling GEMM waits on nothing,
so its programs finish on the other SMs whatever this one holds (deadlock rule 2), and the collective behind the
wait starts only once it returns, as behind the memory operation. A P2P flag's producer is a peer's copy or stream
write after the peer's own work, on another GPU or in another process's time slice of a shared one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashoverlap.kernels.launch import Launcher


# ``index`` and ``value`` are not specialised: one compiled kernel serves every group and tile count, so the kernel a
# graph captures is the one ``load`` compiled and loaded before any capture (deadlock rule 3: a module loaded inside
# a capture can fail or hang there; Triton would otherwise compile apart the value 1 and multiples of 16).
@triton.jit(do_not_specialize=["index", "value"])
def wait_reset_kernel(counters_ptr, index, value):
    # GPU scope: the counter lies in this GPU's memory. A P2P flag is set by a peer's copy engine (tensor-parallel
    # graphs) or stream write (eager calls, the expert path); the work this wait releases is a copy or a kernel
    # queued after it, which starts only once this kernel has ended.
    # The acquire load pairs with the producer's release-ordered increments: once the counter reads ``value``, every
    # tile of the group is visible, to this program and to the work after it on its stream.
    seen = tl.atomic_add(counters_ptr + index, 0, sem="acquire", scope="gpu")
    while seen < value:
        seen = tl.atomic_add(counters_ptr + index, 0, sem="acquire", scope="gpu")
    tl.atomic_xchg(counters_ptr + index, 0, sem="relaxed", scope="gpu")


_LAUNCH = Launcher(wait_reset_kernel)


def wait_reset(counters: torch.Tensor, index: int, value: int) -> None:
    """On the current stream: wait until the int32 ``counters[index] >= value``, then set it to 0."""
    _LAUNCH(1, (counters, index, value), {"num_warps": 1})


def load(device: torch.device) -> None:
    """Compile and load the kernel on ``device`` outside any capture: one launch that returns at once, on a scratch
    counter of its own (a call's counters may still be counting on another stream)."""
    scratch = torch.zeros(1, dtype=torch.int32, device=device)
    with torch.cuda.device(device):
        wait_reset(scratch, 0, 0)
