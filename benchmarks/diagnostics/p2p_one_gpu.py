"""The P2P path's schedule on ONE GPU shared by two processes: a check of its mechanics (symmetric memory, copy
engines, flag waits, and repeated calls replayed from CUDA graphs) where no two-GPU machine is at hand. Not a
performance figure: the two ranks share one GPU's SMs and copy engines. NCCL refuses two ranks on one GPU, so the
group is gloo and the communicator is called directly (the ops ask for an NCCL group); PyTorch's symmetric memory
refuses them too, so the workspace is shared by CUDA IPC instead (``IpcWorkspace``, the same interface).

Each rank makes every rank's inputs from seeds, so the plain PyTorch result is computed locally. Every call's
output is checked (and then poisoned with NaN, so that a later call handed the same memory shows any element it
did not write), eager calls (``FLASHOVERLAP_REPLAY=0``) and replayed ones alike, with a weight-gradient hook
(``replay.Matmul``) on new values held in the replayed graphs (the communicator is called with ``Call``s, as the
runtime calls it); then the host time to issue one
call (the GPU kept busy ahead of it) is printed for eager and replayed calls, beside ``torch.mm`` alone.

CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 2 benchmarks/diagnostics/p2p_one_gpu.py [out.json]
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.bench.timing import host_us
from flashoverlap.comm import symmetric
from flashoverlap.comm.protocol import Call
from flashoverlap.comm.replay import Matmul
from flashoverlap.runtime.context import context_of

SHAPES = [(1002, 1000, 520), (778, 2000, 1234), (4096, 4096, 4096)]  # M divisible by 2
HOST_SHAPE = (4096, 8192, 8192)
OPS = ("reduce_scatter", "all_reduce", "all_gather")


class IpcWorkspace(symmetric.SymmetricWorkspace):
    """``SymmetricWorkspace`` with the buffers exchanged as CUDA IPC handles (which work between processes on one
    GPU) and a host barrier."""

    def ensure(self, nbytes, op, ones=(0, 0)):
        if nbytes <= self.nbytes:
            return False
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.synchronize()
        size = symmetric.size_class(symmetric.FLAG_BYTES + nbytes)
        buffer = torch.zeros(size, dtype=torch.uint8, device=self.device)
        handles = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(handles, reduce_tensor(buffer), group=self.group)
        rank = dist.get_rank(self.group)
        self._peers = [buffer if r == rank else rebuild(*args) for r, (rebuild, args) in enumerate(handles)]
        self.buffer, self.nbytes = buffer, size - symmetric.FLAG_BYTES
        self.flags[ones[0] : ones[1]] = 1
        self.barrier(0)
        return True

    def barrier(self, channel):
        torch.cuda.synchronize()
        dist.barrier(group=self.group)


def operands(op, m, n, k, world, dtype, seed, transposed):
    """Every rank's a (full M rows; all-gather: the shards stacked) and the shared b."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a_all = [torch.randn(m, k, dtype=dtype, device="cuda", generator=gen) for _ in range(world)]
    w = torch.randn(n, k, dtype=dtype, device="cuda", generator=gen) / k**0.5
    b = w.t() if transposed else w.t().contiguous()
    if op == "all_gather":
        full = a_all[0]
        return [full[r * m // world : (r + 1) * m // world] for r in range(world)], b, full @ b
    total = sum(a.float() @ b.float() for a in a_all).to(dtype)
    return a_all, b, total


def expected_rows(op, total, rank, world):
    if op == "reduce_scatter":
        rows = total.shape[0] // world
        return total[rank * rows : (rank + 1) * rows]
    return total


def check(got, want, what):
    nan = bool(torch.isnan(got).any())
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    limit = 1e-2 if got.dtype == torch.bfloat16 else 2e-3
    if nan or err >= limit:
        raise AssertionError(f"{what}: nan={nan} rel_err={err:.2e}")


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", 0)
    comm = context_of(dist.group.WORLD, device).communicator("gemm", "p2p")
    comm.workspace = IpcWorkspace(dist.group.WORLD, device)
    report = {"meta": {"gpus": f"1x {torch.cuda.get_device_name()} shared by {world} processes",
                       "torch": torch.__version__, "commit": os.environ.get("FLASHOVERLAP_COMMIT", "unknown"),
                       "command": "torchrun --nproc-per-node 2 benchmarks/diagnostics/p2p_one_gpu.py",
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
              "checked": 0, "host_us": {}}
    for op in OPS:
        for i, (m, n, k) in enumerate(SHAPES):
            for dtype in (torch.bfloat16, torch.float16):
                for transposed in (True, False):
                    a_all, b, total = operands(op, m, n, k, world, dtype, 31 * i, transposed)
                    a, want = a_all[rank], expected_rows(op, total, rank, world)
                    plan = fo.default_plan(op, m, n, k, world, path="p2p", allow_sequential=False)
                    x = torch.randn(k, m, dtype=dtype, device="cuda")  # a weight gradient as the hook's work
                    y = torch.randn(m, n, dtype=dtype, device="cuda")
                    for replay in ("0", "1"):
                        replays = comm.graphs.replays
                        for call in range(4):
                            x.normal_()  # new values in the same tensors: a graph must read them
                            grad = torch.full((k, n), float("nan"), dtype=dtype, device="cuda")
                            hooked = call % 2 == 0 or replay == "1"
                            got, gathered = comm.run(Call(op, plan, a, b, op == "all_gather",
                                                          Matmul(x, y, grad) if hooked else None,
                                                          replay=replay == "1"))
                            torch.cuda.synchronize()
                            what = f"{op} {m}x{n}x{k} {dtype} b{'.t()' if transposed else ''} replay={replay} #{call}"
                            check(got, want, what)
                            if hooked:
                                check(grad, x @ y, what + " hook")
                            if gathered is not None:
                                check(gathered, torch.cat(a_all), what + " gathered")
                            got.fill_(float("nan"))
                            del got, gathered, grad  # the next call gets the same memory back
                            report["checked"] += 1
                        if replay == "1" and comm.graphs.replays - replays < 2:
                            count = comm.graphs.replays - replays
                            raise AssertionError(f"{op} {m}x{n}x{k}: {count} replays of 4 calls")
        print(f"rank {rank}: {op}: correct, eager and replayed ({report['checked']} calls so far, "
              f"{comm.graphs.captures} captures, {comm.graphs.replays} replays)", flush=True)
    m, n, k = HOST_SHAPE
    for op in OPS:
        rows = m // world if op == "all_gather" else m
        a = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()
        plan = fo.default_plan(op, m, n, k, world, path="p2p", allow_sequential=False)
        for replay in ("0", "1"):
            call = Call(op, plan, a, b, replay=replay == "1")
            report["host_us"][f"{op} replay={replay}"] = host_us(lambda call=call: comm.run(call), calls=30)
        report["host_us"][f"{op} torch.mm"] = host_us(lambda a=a, b=b: torch.mm(a, b), calls=30)
    if rank == 0:
        print(json.dumps(report, indent=1), flush=True)
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
