"""The sequential fallback: ``torch.mm`` and then one NCCL collective on the whole result, what a plan with
``sequential=True`` runs where overlap cannot pay (small GEMMs, short collectives). The collective is issued
straight to the group (``collectives.*_now``): these calls are small, and their host time is the cost.

So a repeated call is replayed, as the overlapped paths' are (``comm/replay.py``): every tensor the call writes is
allocated first, in one order (``_buffers``), the matmul writes into its buffer (``out=``), and a call that repeats
on the same tensors (``call.replay``, a hook that is ``HeldHook`` or none) is one graph launch, the collective
inside the graph. On a GPU only (the graph is a CUDA graph); a first call, and every call where the runtime says no
(``FLASHOVERLAP_REPLAY=0``, debug mode, ``CUDA_DEVICE_MAX_CONNECTIONS=1``, inside a user's capture), is issued
eagerly."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashoverlap.comm import scaled
from flashoverlap.comm.collectives import (
    all_gather_now,
    all_gather_pair_now,
    all_reduce_now,
    reduce_scatter_now,
    refuse_coalescing,
)
from flashoverlap.comm.protocol import Call, CommGroup, HeldHook
from flashoverlap.comm.replay import CallGraphs, addresses, allocate, gemm_call_inputs, gemm_call_signature


class SequentialCommunicator:
    """Plans with ``sequential=True`` behind the communicator protocol (``comm/protocol.py``): holds the graphs of
    its repeated calls."""

    path = "sequential"

    def __init__(self, group: CommGroup) -> None:
        self.group = group
        self.graphs = CallGraphs(group.device)
        self._graphed = group.device.type == "cuda"

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The op's result (and all-gather's gathered input where asked), as plain PyTorch computes it; the hook is
        issued once the collective is queued, so that it runs beside it."""
        refuse_coalescing(self.group.process_group, call.name)
        buffers = self._buffers(call)
        hook = call.hook
        if call.replay and self._graphed and (hook is None or isinstance(hook, HeldHook)):
            signature = self._signature(call, buffers)
            if self.graphs.run(signature, lambda: self._issue(call, buffers)):
                return _result(call, buffers)
        self._issue(call, buffers)
        return _result(call, buffers)

    def release(self) -> None:
        self.graphs.clear()

    @staticmethod
    def _buffers(call: Call) -> list[torch.Tensor]:
        """Every tensor the call writes, allocated in one order on every call (eager, captured, replayed):
        all-reduce ``(c,)``; reduce-scatter ``(out, product)``; all-gather ``(c, a_full)``, fp8 ``(c, a_full,
        scale_full)``."""
        return allocate(_shapes(call), call.a.device)

    def replayer(self, call: Call) -> Callable[[object], tuple | None] | None:
        """The replay lane of calls that read ``call``'s tensors (``comm/protocol.py``, ``CallGraphs.replayer``);
        None where none applies: not replayed, a hook, off the GPU, no graph held yet."""
        if not (call.replay and self._graphed and call.hook is None) or not self.graphs:
            return None
        shapes, device, process_group, name = _shapes(call), call.a.device, self.group.process_group, call.name
        op, gathered, fp8 = call.plan.op, call.return_gathered, call.scales is not None

        def written() -> tuple[tuple, list]:  # ``_buffers``' tensors, and where they lie
            refuse_coalescing(process_group, name)  # as ``run``: the call's collective is the group's, now
            buffers = allocate(shapes, device)
            return addresses(buffers), buffers

        return self.graphs.replayer(gemm_call_inputs(call), written,
                                    lambda buffers: _result_of(op, gathered, fp8, buffers))

    @staticmethod
    def _signature(call: Call, buffers: tuple[torch.Tensor, ...]) -> tuple:
        """``replay.gemm_call_signature`` over the call's buffers (``comm/replay.py``)."""
        return gemm_call_signature(call, addresses(buffers))

    def _issue(self, call: Call, buffers: tuple[torch.Tensor, ...]) -> None:
        plan, a, b, scales, process_group = call.plan, call.a, call.b, call.scales, self.group.process_group
        if plan.op == "all_gather":
            c, a_full = buffers[0], buffers[1]
            if scales is None:
                all_gather_now(a_full, a.contiguous(), process_group)
                torch.mm(a_full, b, out=c)
            else:  # the shard's fp8 rows and their scales (tensor-wise: its one scale per row) in one collective
                scale_full = buffers[2]
                all_gather_pair_now((a_full, scale_full),
                                    (a.contiguous(), scales.shard_rows(a.shape[0]).contiguous()), process_group)
                scaled.scaled_mm(a_full, b, scales, scale_full, out=c)
        else:
            product = buffers[-1]
            if scales is None:
                torch.mm(a, b, out=product)
            else:  # the reductions move the output dtype's partials (NCCL sums them)
                scaled.scaled_mm(a, b, scales, out=product)
            if plan.op == "all_reduce":
                all_reduce_now(product, process_group)
            else:
                reduce_scatter_now(buffers[0], product, process_group)
        if call.hook is not None:
            call.hook()


def _shapes(call: Call) -> tuple:
    """``(shape, dtype)`` of every tensor the call writes, in ``_buffers``' order."""
    plan, a, scales = call.plan, call.a, call.scales
    out_dtype = a.dtype if scales is None else scales.out_dtype
    c = ((plan.m, plan.n), out_dtype)
    if plan.op == "all_gather":
        a_full = ((plan.m, plan.k), a.dtype)
        if scales is None:
            return c, a_full
        return c, a_full, ((plan.m, scales.scale_columns(plan.k)), torch.float32)
    if plan.op == "all_reduce":
        return (c,)
    return ((plan.block_rows, plan.n), out_dtype), c


def _result(call: Call, buffers: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, object]:
    """The result, and all-gather's gathered input where asked (fp8: with its scales)."""
    return _result_of(call.plan.op, call.return_gathered, call.scales is not None, buffers)


def _result_of(op: str, return_gathered: bool, fp8: bool, buffers: tuple[torch.Tensor, ...]) -> tuple:
    if op != "all_gather" or not return_gathered:
        return buffers[0], None
    return buffers[0], (buffers[1], buffers[2]) if fp8 else buffers[1]
