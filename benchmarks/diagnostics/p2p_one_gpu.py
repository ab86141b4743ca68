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
call (the GPU kept busy ahead of it) is printed for eager and replayed calls, beside ``torch.mm`` alone, timed
interleaved (``bench.timing.host_us_interleaved``: one call of each per round, ``HOST_ROUNDS`` rounds, medians;
also the paired figures, the median over rounds of a call's ratio to ``torch.mm`` and, for the sequential plan, of
its difference from the direct call in the same round).

CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 2 -m benchmarks.diagnostics.p2p_one_gpu [out.json]
"""

import json
import os

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results
from benchmarks.harness.timing import host_us_interleaved
from flashoverlap.comm import symmetric
from flashoverlap.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from flashoverlap.comm.protocol import Call
from flashoverlap.comm.replay import Matmul
from flashoverlap.runtime.context import context_of

SHAPES = [(1002, 1000, 520), (778, 2000, 1234), (4096, 4096, 4096)]  # M divisible by 2
HOST_SHAPE = (4096, 8192, 8192)  # the host-time shape (host time, not GPU time, is what is compared)
# Rounds of the interleaved host timings: one cold call's host time moves by tens of percent from call to call
# (`torch.mm`'s own median moved between 81 and 167 us across runs at 40 rounds), so the medians take many.
HOST_ROUNDS = 150
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


def direct_call(op, a, b, group, out_rows):
    """The work of a call of the sequential plan in plain PyTorch on ``group``, allocating its outputs as the op
    does: the ``direct`` baseline of the host rows (``out_rows``: all-gather's gathered rows, reduce-scatter's
    rows of the result on this rank; given, so that the baseline asks nothing of the group per call)."""
    if op == "all_gather":
        gathered = torch.empty(out_rows, a.shape[1], dtype=a.dtype, device=a.device)
        all_gather_into_tensor(gathered, a, group)
        return torch.mm(gathered, b)
    c = torch.mm(a, b)
    if op == "all_reduce":
        dist.all_reduce(c, group=group)
        return c
    out = torch.empty(out_rows, c.shape[1], dtype=a.dtype, device=a.device)
    reduce_scatter_tensor(out, c, group)
    return out


def host_operands(op: str, world: int) -> tuple[torch.Tensor, torch.Tensor, fo.Plan]:
    """Fresh operands of ``op`` at ``HOST_SHAPE`` (all-gather: this rank's shard; b as ``w.t()``) and the P2P
    path's default overlapped plan for them: the call whose host time the diagnostics time."""
    m, n, k = HOST_SHAPE
    a = torch.randn(m // world if op == "all_gather" else m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()
    return a, b, fo.default_plan(op, m, n, k, world, path="p2p", allow_sequential=False)


def host_rows(comm, rank, world) -> list[dict]:
    """Host time per call at ``HOST_SHAPE`` (issued while the GPU is busy), in one run: the P2P communicator eager
    and replayed, ``torch.mm`` alone; and on a one-rank NCCL group (one per process: NCCL takes one rank on the
    shared GPU), the public op (its plan is the sequential one) against ``torch.mm`` plus the same collective issued
    directly. Also a cProfile of eager calls, printed, for where the time goes."""
    import cProfile
    import io
    import pstats

    m, n, k = HOST_SHAPE
    solo = [dist.new_group([r], backend="nccl") for r in range(world)][rank]  # collective: every rank makes each
    public = fo.ops.GEMM_OPS
    rows = []
    for op in OPS:
        a, b, plan = host_operands(op, world)
        calls = {mode: Call(op, plan, a, b, replay=replay) for mode, replay in (("eager", False), ("replayed", True))}
        for call in calls.values():  # kernels loaded, graphs captured: the timed calls are the steady ones
            comm.run(call)
            comm.run(call)
        us = host_us_interleaved({"torch.mm": lambda a=a, b=b: torch.mm(a, b),
                                  **{mode: lambda call=call: comm.run(call) for mode, call in calls.items()}},
                                 calls=HOST_ROUNDS, pairs=tuple((mode, "torch.mm") for mode in calls))
        for mode in calls:
            rows.append({"op": op, "path": "p2p", "mode": mode, "M": m, "N": n, "K": k, "host_us": round(us[mode], 1),
                         "torch_mm_us": round(us["torch.mm"], 1), "direct_us": None,
                         "paired_ratio": round(us[f"{mode} / torch.mm"], 2)})
        eager = Call(op, plan, a, b)
        profile = cProfile.Profile()
        for _ in range(10):
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)
            profile.enable()
            comm.run(eager)
            profile.disable()
        if rank == 0:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(10)
            print(f"== eager {op}: cProfile of 10 calls\n" + "\n".join(
                line for line in text.getvalue().splitlines() if line.strip()), flush=True)
        # The sequential plan: the public op on a one-rank NCCL group, beside the same work issued directly.
        full = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")

        def direct(op=op, full=full, b=b):
            return direct_call(op, full, b, solo, m)

        us = host_us_interleaved({"ours": lambda op=op, full=full, b=b: public[op](full, b, group=solo),
                                  "direct": direct, "torch.mm": lambda full=full, b=b: torch.mm(full, b)},
                                 calls=HOST_ROUNDS, pairs=(("ours", "direct"),))
        rows.append({"op": op, "path": "nccl", "mode": "sequential", "M": m, "N": n, "K": k,
                     "host_us": round(us["ours"], 1), "torch_mm_us": round(us["torch.mm"], 1),
                     "direct_us": round(us["direct"], 1), "paired_extra_us": round(us["ours - direct"], 1)})
    return rows


def release_check(comm, device) -> dict:
    """The communicator's release frees its graphs and workspace: caching-allocator memory before and after."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(device)
    graphs = len(comm.graphs)
    comm.release()
    gc.collect()
    torch.cuda.synchronize()
    freed = held - torch.cuda.memory_allocated(device)
    if len(comm.graphs) or comm.workspace.buffer is not None:
        raise AssertionError("release left graphs or the workspace in place")
    return {"graphs_before": graphs, "bytes_freed": freed, "workspace_after": None}


def open_run(script: str) -> tuple[int, int, torch.device, dict]:
    """The start of every two-process one-GPU diagnostic: the gloo world group on GPU 0; returns this process's
    rank, the world size, the device and the results file's ``meta`` for ``script`` (its commit from
    ``FLASHOVERLAP_COMMIT``: the device machine's git snapshot is stale)."""
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    command = f"CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 2 -m benchmarks.diagnostics.{script} OUT.json"
    meta = results_meta(command, f"1x {torch.cuda.get_device_name()} shared by {world} processes")
    return rank, world, torch.device("cuda", 0), meta


def ipc_p2p(device: torch.device):
    """The world group's P2P communicator, its workspace exchanged by CUDA IPC."""
    comm = context_of(dist.group.WORLD, device).communicator("gemm", "p2p")
    comm.workspace = IpcWorkspace(dist.group.WORLD, device)
    return comm


def close_run(results: dict, rank: int) -> None:
    """Rank 0 prints the results and writes them to the path given (``write_results``); then every rank leaves."""
    if rank == 0:
        print(json.dumps(results, indent=1), flush=True)
        write_results(results)
    dist.barrier()
    dist.destroy_process_group()


def main():
    require_cuda("benchmarks.diagnostics.p2p_one_gpu", path_only=True)
    rank, world, device, meta = open_run("p2p_one_gpu")
    comm = ipc_p2p(device)
    report = {"meta": meta, "checked": 0}
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
    report["rows"] = host_rows(comm, rank, world)
    report["release"] = release_check(comm, device)
    close_run(report, rank)


if __name__ == "__main__":
    main()
