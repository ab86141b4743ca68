"""The P2P communicator's own code (``reduce``, ``all_gather``: their address arithmetic, flags, copies and sums)
run on the CPU: CUDA streams are stubs, stream memory operations and copy engines become plain reads, writes and
memmoves on CPU tensors, the symmetric workspace is a set of CPU buffers, and the two ranks are threads. Run in a
child process by ``tests/comm/test_p2p_executor.py``: it replaces parts of ``torch.cuda``. Prints ``<op> ok``."""

import sys
import threading
import traceback

import torch

import flashoverlap.comm.p2p as p2p
from flashoverlap.comm import symmetric
from flashoverlap.comm.collectives import gathered_in_rank_order
from flashoverlap.plan import TileConfig, default_plan
from tests.comm import fake_cuda

W = 2
TILE = TileConfig(16, 16, 16, 2, 1, 4)


class FakeWorkspace:
    """``SymmetricWorkspace``'s interface over CPU buffers shared by the thread-ranks."""

    def __init__(self, rank, buffers, barrier):
        self.rank, self.buffers, self.barrier_ = rank, buffers, barrier
        self.nbytes = 0

    def ensure(self, nbytes, op):  # collective, as the rendezvous is: every buffer exists before anyone goes on
        if nbytes > self.nbytes:
            self.buffers[self.rank] = torch.zeros(symmetric.FLAG_BYTES + nbytes, dtype=torch.uint8)
            self.nbytes = nbytes
            self.barrier_.wait()

    @property
    def flags(self):
        return self.buffers[self.rank][: symmetric.FLAG_BYTES].view(torch.int32)

    def flag_ptr(self, rank, slot):
        return self.buffers[rank].data_ptr() + 4 * slot

    def local(self, shape, dtype):
        count = 1
        for s in shape:
            count *= s
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.buffers[self.rank][symmetric.FLAG_BYTES : symmetric.FLAG_BYTES + nbytes].view(dtype).view(shape)

    def peer_ptr(self, rank):
        return self.buffers[rank].data_ptr() + symmetric.FLAG_BYTES

    def barrier(self, channel):
        self.barrier_.wait()


def _communicators():
    buffers, barrier = {}, threading.Barrier(W)
    comms = []
    for rank in range(W):
        comm = object.__new__(p2p.P2PCommunicator)
        comm.rank, comm.world_size, comm.device = rank, W, torch.device("cpu")
        comm.copy_stream = fake_cuda.Stream()
        comm.flags = torch.zeros(64, dtype=torch.int32)
        comm.counters = torch.zeros(64, dtype=torch.int32)
        comm.workspace = FakeWorkspace(rank, buffers, barrier)
        comm._summed = set()
        comms.append(comm)
    return comms


def _threads(fn):
    errors = []

    def run(rank):
        try:
            fn(rank)
        except Exception:  # reported by the parent
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def check_reduction(op, m):
    plan = default_plan(op, m, 40, 24, W, tile=TILE, num_groups=3, path="p2p", allow_sequential=False)
    partials = [torch.randn(m, 40, dtype=torch.float64) for _ in range(W)]
    comms, outs = _communicators(), {}

    def rank_call(rank):
        comm = comms[rank]
        workspace = comm.prepare_reduction(plan, torch.float64)
        for a_row, out_row, rows in zip(*plan.tile_rows()):  # the GEMM: partial products where the plan puts them
            workspace[out_row : out_row + rows] = partials[rank][a_row : a_row + rows]
        for grp in plan.groups:
            comm.counters[grp.index] = grp.tile_count
        out_rows = plan.block_rows if op == "reduce_scatter" else m
        outs[rank] = torch.full((out_rows, 40), float("nan"), dtype=torch.float64)
        comm.reduce(outs[rank], plan)

    _threads(rank_call)
    total = sum(partials)
    for rank, comm in enumerate(comms):
        want = total[rank * plan.block_rows : (rank + 1) * plan.block_rows] if op == "reduce_scatter" else total
        torch.testing.assert_close(outs[rank], want)
        assert not comm.counters.any() and not comm.workspace.flags.any(), "state left for the next call"
    print(op, "ok", flush=True)


def check_all_gather(rows):
    plan = default_plan("all_gather", rows * W, 40, 24, W, tile=TILE, num_groups=3, path="p2p",
                        allow_sequential=False)
    shards = [torch.randn(rows, 24, dtype=torch.float64) for _ in range(W)]
    comms, gathered = _communicators(), {}

    def rank_call(rank):
        gathered[rank] = torch.full((plan.m, 24), float("nan"), dtype=torch.float64)
        comms[rank].all_gather(gathered[rank], shards[rank], plan)
        comms[rank].finish_all_gather(plan)

    _threads(rank_call)
    for rank in range(W):
        torch.testing.assert_close(gathered_in_rank_order(gathered[rank], plan), torch.cat(shards))
        assert not comms[rank].flags.any()
    print("all_gather ok", flush=True)


if __name__ == "__main__":
    fake_cuda.install(wait_timeout_s=10.0)
    check_reduction("reduce_scatter", 96)
    check_reduction("all_reduce", 77)
    check_all_gather(40)
    sys.exit(0)
