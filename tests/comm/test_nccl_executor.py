"""The NCCL communicator's own code (group slices, workspace layout, counters, flags, per-band events) run on the
CPU: each rank is a gloo process in which CUDA streams are stubs and the stream memory operations are plain memory
reads and writes; the collectives are real (gloo). The GEMM's part is played by cuBLAS-band code (``torch.matmul``
per band) or by setting the counters as the kernel would."""

import pytest
import torch
import torch.distributed as dist

from flashoverlap.testing import spawn
from tests.comm import fake_cuda


def _ranks(rank, world_size):
    fake_cuda.install(wait_timeout_s=0.0)  # one rank per process: a counter is set before its wait
    from flashoverlap.comm.collectives import gathered_in_rank_order
    from flashoverlap.comm.nccl import NcclCommunicator, compute_bands
    from flashoverlap.comm.state import state_of
    from flashoverlap.plan import TileConfig, default_plan

    tile = TileConfig(16, 16, 16, 2, 1, 4)
    comm = NcclCommunicator(state_of(dist.group.WORLD, torch.device("cpu")))
    gen = torch.Generator().manual_seed(rank)
    m, n, k = 48 * world_size, 40, 24
    a, b = torch.randn(m, k, generator=gen, dtype=torch.float64), torch.randn(k, n, generator=gen, dtype=torch.float64)
    total = a @ b
    dist.all_reduce(total)
    checked = []
    for op in ("all_reduce", "reduce_scatter"):
        for gemm_kind in ("cublas", "triton"):
            plan = default_plan(op, m, n, k, world_size, tile=tile, num_groups=3, gemm=gemm_kind,
                                allow_sequential=False)
            comm.prepare(plan, torch.float64)
            target = torch.full((m, n), float("nan"), dtype=torch.float64)
            compute_bands(a, b, plan, target)  # the product in the plan's layout
            ready = None
            if gemm_kind == "cublas":
                ready = [object() for _ in plan.groups]  # the bands' events (stub streams ignore them)
            else:
                for grp in plan.groups:  # what the signalling kernel leaves behind
                    comm.counters[grp.index] = grp.tile_count
            if op == "all_reduce":
                comm.all_reduce(target, plan, ready)
                torch.testing.assert_close(target, total)
            else:
                out = torch.full((plan.block_rows, n), float("nan"), dtype=torch.float64)
                comm.reduce_scatter(out, target, plan, ready)
                torch.testing.assert_close(out, total[rank * plan.block_rows : (rank + 1) * plan.block_rows])
            assert not comm.counters.any(), "counters not reset for the next call"
            checked.append((op, gemm_kind))
    plan = default_plan("all_gather", m, n, k, world_size, tile=tile, num_groups=3, comm_ctas=0,
                        allow_sequential=False)  # NCCL's own CTA count: no capped NCCL group on gloo
    comm.prepare(plan, torch.float64)
    shard = a[: plan.block_rows].contiguous()
    gathered = torch.full((m, k), float("nan"), dtype=torch.float64)
    comm.all_gather(gathered, shard, plan)
    assert comm.flags[: plan.num_groups].tolist() == [1] * plan.num_groups
    full = torch.empty((m, k), dtype=torch.float64)
    dist.all_gather_into_tensor(full, shard)
    torch.testing.assert_close(gathered_in_rank_order(gathered, plan), full)
    comm.finish_all_gather(plan)
    assert not comm.flags.any()
    return len(checked)


@pytest.mark.parametrize("world_size", [2, 3])
def test_nccl_communicator_code_with_stub_streams(world_size):
    assert spawn(_ranks, world_size, "gloo") == [4] * world_size
