"""``all_gather_gemm(a_shard, b)``: ``all_gather(a_shard) @ b``, each band of the gathered input multiplied as it
arrives.

Column-parallel linear layer with sequence parallelism: rank r holds ``a_shard_r: [M/W, K]`` (its rows of the
sequence) and ``b_r: [K, N/W]``; every rank computes ``[M, N/W] = all_gather(a_shard) @ b_r``. The plan computes
the rank's own shard first, then each group's band of the other shards as it arrives (``Plan.tile_rows``).

P2P path (``path="p2p"``, NVLink): copy engines pull each band from the peers' symmetric memory and raise the
same flags; the GEMM holds every SM (``comm/p2p.py``).

NCCL path: the communication stream gathers band after band (launched before the GEMM: here it is the producer)
and raises a flag per band; the GEMM, persistent on all SMs but those left to NCCL, computes its own shard and
then waits in-kernel for each band's flag. NCCL runs a fixed ``comm_ctas`` CTAs on SMs the GEMM never takes, so
every wait is satisfiable (deadlock rule 2); the op refuses plans that leave fewer SMs than
``flashoverlap.plan.nccl_free_sms``: the CTAs' count plus a margin, because through host memory NCCL made no
progress beside a GEMM that left it exactly its CTAs' SMs.

Inside a CUDA-graph capture the in-kernel waits are replaced by graph edges (see ``_captured``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm import nccl, p2p, reference
from flashoverlap.comm.collectives import all_gather_into_tensor, gathered_in_rank_order
from flashoverlap.kernels.gemm import gemm
from flashoverlap.ops._common import prepare_call
from flashoverlap.plan import Plan, nccl_free_sms

OP = "all_gather_gemm"


def all_gather_gemm(
    a_shard: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    plan: Plan | None = None,
    path: str = "auto",
    return_gathered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``all_gather(a_shard) @ b``: ``[M, N]`` with ``M = W * a_shard.shape[0]``; with ``return_gathered``, also
    the gathered ``[M, K]`` input (rank order), as ``dist.all_gather_into_tensor`` would return it."""
    path, group, plan = prepare_call(OP, "all_gather", a_shard, b, group, plan, path)
    if path == "reference":
        c, a_full = reference.all_gather_gemm(a_shard, b, plan, group, dist.get_rank(group))
        return (c, a_full) if return_gathered else c
    device = a_shard.device
    with torch.cuda.device(device):
        if plan.sequential:
            a_full = torch.empty((plan.m, plan.k), dtype=a_shard.dtype, device=device)
            all_gather_into_tensor(a_full, a_shard.contiguous(), group)
            c = torch.matmul(a_full, b)
            return (c, a_full) if return_gathered else c
        if path == "p2p":
            comm = p2p.communicator(group, device)
        else:
            if plan.gemm == "triton":  # only a GEMM that spins on the bands can starve NCCL
                check_leaves_nccl_sms(plan, torch.cuda.get_device_properties(device).multi_processor_count)
            comm = nccl.communicator(group, device)
            comm.prepare(plan, a_shard.dtype)
        gathered = torch.empty((plan.m, plan.k), dtype=a_shard.dtype, device=device)
        if plan.gemm == "cublas" or torch.cuda.is_current_stream_capturing():
            c = _bands_by_cublas(comm, gathered, a_shard, b, plan)
            return (c, gathered_in_rank_order(gathered, plan)) if return_gathered else c
        _cublas_ready(device, a_shard.dtype)
        comm.all_gather(gathered, a_shard, plan)
        timeout = nccl.debug_timeout()
        wait_error = torch.zeros(1, dtype=torch.int32, device=device) if timeout else None
        # About a microsecond a poll: the debug bound in polls.
        max_spins = int(timeout * 1e6) if timeout else 0
        c = gemm(gathered, b, plan, flags=comm.flags, rank=comm.rank, wait_error=wait_error, max_spins=max_spins)
        comm.finish_all_gather(plan)
        if wait_error is not None and int(wait_error.item()):
            g = int(wait_error.item()) - 1
            raise RuntimeError(
                f"flashoverlap: rank {comm.rank}: {OP} waited more than about {timeout:g} s for group {g} of "
                f"{plan.num_groups} (FLASHOVERLAP_DEBUG_TIMEOUT); its band never arrived"
            )
        return (c, gathered_in_rank_order(gathered, plan)) if return_gathered else c


_CUBLAS_READY: set[tuple[torch.device, torch.dtype]] = set()


def check_leaves_nccl_sms(plan: Plan, num_sms: int) -> None:
    """Deadlock rule 2: the GEMM spins on bands that NCCL delivers, so it must leave NCCL ``nccl_free_sms`` SMs
    (its CTAs and a margin) that it never occupies."""
    free = nccl_free_sms(num_sms, plan.comm_ctas)
    if plan.comm_ctas < 1 or plan.grid_size + free > num_sms:
        raise ValueError(
            f"{OP}: the plan's GEMM ({plan.grid_size} programs) waits for bands NCCL delivers with "
            f"{plan.comm_ctas} CTAs; it needs comm_ctas >= 1 and programs <= {num_sms} SMs - {free} left to NCCL, "
            "or the waits could starve NCCL of SMs and hang (DESIGN.md, deadlock rule 2)"
        )


def _cublas_ready(device: torch.device, dtype: torch.dtype) -> None:
    """Create this thread's cuBLAS handle on an eager call: the captured schedule multiplies with cuBLAS, and
    creating a handle inside a capture fails (CUBLAS_STATUS_NOT_INITIALIZED, seen on the H200s)."""
    if (device, dtype) not in _CUBLAS_READY:
        torch.matmul(torch.zeros(1, 1, dtype=dtype, device=device), torch.zeros(1, 1, dtype=dtype, device=device))
        _CUBLAS_READY.add((device, dtype))


def _bands_by_cublas(comm: nccl.NcclCommunicator | p2p.P2PCommunicator, gathered: torch.Tensor,
                     a_shard: torch.Tensor, b: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Plans with ``gemm="cublas"``, and every call inside a CUDA-graph capture: the same bands gathered in the
    same order, but each band's slots multiplied by cuBLAS once the band's event has fired, the dependency a stream
    (graph) edge instead of an in-kernel spin. In a graph this is required: a graph may serialize its branches
    onto one hardware queue, where a spinning GEMM ahead of the NCCL kernels it waits for would never finish (the
    in-kernel schedule hung under graph replay on the H200s; that serialization is the likely cause, not a proven
    one). Overlap in a graph is therefore decomposition-like."""
    arrived = comm.all_gather(gathered, a_shard, plan, events=True)
    producer = torch.cuda.current_stream(gathered.device)
    c = torch.empty((plan.m, plan.n), dtype=gathered.dtype, device=gathered.device)
    c_blocks = c.view(plan.world_size, plan.block_rows, plan.n)  # rank r's rows of the result: c_blocks[r]

    def multiply(grp, r):
        band = gathered[grp.out_row_start : grp.out_row_end].view(plan.world_size, grp.rows, plan.k)
        torch.matmul(band[r], b, out=c_blocks[r, grp.row_start : grp.row_end])

    for grp in plan.groups:  # the own shard is in place before the first collective: no wait
        multiply(grp, comm.rank)
    for grp, event in zip(plan.groups, arrived):
        producer.wait_event(event)
        for step in range(1, plan.world_size):
            multiply(grp, (comm.rank + step) % plan.world_size)
    comm.finish_all_gather(plan)
    return c
