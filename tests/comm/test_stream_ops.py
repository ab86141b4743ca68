"""The bytes the ctypes driver hands to ``cuStreamBatchMemOp`` (``comm/stream_ops.py``), read back without a GPU:
two CUstreamBatchMemOpParams of 48 bytes, a wait for >= 1 and then a write of 0, on the same address, in that
order (the order is the protocol: a reset before the wait would lose the signal)."""

import struct

import pytest
import torch

from flashoverlap.comm import stream_ops


def _driver(calls):
    import ctypes

    driver = object.__new__(stream_ops.FastDriver)
    driver._pair = ctypes.create_string_buffer(2 * stream_ops._MEM_OP.size)

    def batch(stream, count, params, flags):
        calls.append((stream, count, bytes(params.raw[: count * 48]), flags))
        return 0

    driver._batch = batch
    return driver


@pytest.mark.parametrize("address", [0x7F00_0000_1000, 0x1234])
def test_a_wait_and_reset_is_one_batch_of_a_wait_for_one_then_a_write_of_zero(address):
    calls = []
    _driver(calls).wait_reset(0xABC, address)
    [(stream, count, raw, flags)] = calls
    assert (stream, count, flags) == (0xABC, 2, 0)
    ops = [struct.unpack_from("<IIQQII", raw, 48 * i) for i in range(2)]  # operation, pad, address, value, flags
    assert ops[0] == (1, 0, address, 1, 0, 0)  # CU_STREAM_MEM_OP_WAIT_VALUE_32, value 1, CU_STREAM_WAIT_VALUE_GEQ
    assert ops[1] == (2, 0, address, 0, 0, 0)  # CU_STREAM_MEM_OP_WRITE_VALUE_32, value 0


def test_a_failed_batch_raises():
    driver = _driver([])
    driver._batch = lambda *args: 1
    with pytest.raises(RuntimeError, match="cuStreamBatchMemOp"):
        driver.wait_reset(1, 0x1000)


@pytest.mark.parametrize("executor", ["tp", "expert"])
def test_graphs_wait_with_the_kernel_on_a_gpu_unless_told(executor):
    """Both P2P executors ask the one rule: the wait kernel in a graph on a GPU, memory operations elsewhere, either
    where the executor's ``graph_waits`` forces it."""
    from flashoverlap.comm.expert.p2p import ExpertP2PCommunicator
    from flashoverlap.comm.tp.p2p import P2PCommunicator

    comm = object.__new__({"tp": P2PCommunicator, "expert": ExpertP2PCommunicator}[executor])
    comm.device = torch.device("cuda", 0)  # a device object only: nothing runs on it
    assert comm._graph_waits() == "kernel"
    comm.graph_waits = "memop"
    assert comm._graph_waits() == "memop"
    comm.graph_waits, comm.device = None, torch.device("cpu")
    assert comm._graph_waits() == "memop"
