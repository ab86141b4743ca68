"""The fp8 signalling GEMM's tile shape and launch per problem shape and scaling mode: policy, measured on one H200
(torch 2.11, Triton 3.6; benchmarks/results/h200x1-fp8-gemm.json and the sweep behind it, issue 35).

What the sweep of 128x256, 256x128, 128x128 and 64x{128,256} tiles, 64- and 128-deep K steps, 3 and 4 stages, 4, 8
and 16 warps, one program per tile against one per SM, found at the grid's per-rank GEMMs (M >= 2048):

- tensor-wise and row-wise (scales in the epilogue): 128x256x128, 8 warps, one program per SM (persistent) was the
  best or within 1-2% of it everywhere; 128x128 tiles with 4 warps (two programs per SM) came within 2-5%; 256x128
  and 64-deep K lost 3-9%. Under the launch the overlapped plans give it (``fp8_tile_sweep.py``, logs/issue35 at
  3e7c7ffcb8): all-reduce and reduce-scatter (one program per tile, which lets NCCL's blocks in) best with 128x256x128
  at 3 stages, 4 where K is 7168 deep (+3-10% there; 0.87-1.03x ``_scaled_mm`` at the best tile, so the rest of the
  gap is the launch, not the tile); 128x128x128 with 4 warps, 3 stages was best only at K = 2048, by 0-4%, and
  4-stage 128x128 tiles lost 10-20%. The all-gather (persistent on the SMs NCCL leaves) best at 4 stages everywhere
  (0.90-1.01x ``_scaled_mm`` given the same SMs).
- block-wise (scales inside the K loop, so ``block_k`` is 128 and every 128-deep slab is multiplied on its own and
  then scaled): two fp32 accumulators per tile, so 128x128 tiles with 8 warps and 4 stages, persistent; 128x256 tiles
  spill (0.43x) and 16 warps did not help. Neither did keeping one accumulator rescaled by the ratio of successive
  scales (0.37-0.52x) nor applying slab k's scales after issuing slab k+1's product (0.54-0.63x). At 0.56-0.79x of
  torch's block-wise kernel on all-reduce plans, and 0.44-0.55x on the row-mapped (reduce-scatter, all-gather) ones:
  the same registers (167-169, no spills), so the loss there is in the K loop's per-slab scale loads, whose rows come
  from the plan's row table (an hypothesis, not measured apart).
"""

from __future__ import annotations

from typing import NamedTuple

from flashoverlap.plan import Plan, TileConfig
from flashoverlap.tune.defaults import default_plan

SCALINGS = ("tensor", "row", "block")
# Groups of the NCCL path's cuBLAS-band fp8 plans (block-wise): torch's block-wise scaled matmul on 4 bands per call
# (2 per rank block) ran 0.94-1.16x of it whole; on the 8 bands of 4 groups of a reduce-scatter, 0.23-0.92x
# (h200x1-fp8-gemm.json; logs/issue35, at 479fd20e1a).
CUBLAS_BANDS = 2
# fp8 GEMMs ran 1.7-2.0x bf16 torch.mm's throughput at the grid (h200x1-fp8-gemm.json): the overlap rule's estimate of
# an fp8 GEMM's time is the bf16 one's over this.
FP8_GEMM_SPEEDUP = 1.8
# K loops at least this deep took 4 pipeline stages under one program per tile (tensor-wise and row-wise).
DEEP_PIPELINE_K = 6144


class Fp8Tiles(NamedTuple):
    """One launch of the fp8 GEMM: the tile and pipeline, and whether it runs one program per SM (``persistent``:
    ``num_programs`` = the SM count) rather than one per tile."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int
    persistent: bool

    def tile_config(self) -> TileConfig:
        return TileConfig(self.block_m, self.block_n, self.block_k, self.group_m, self.num_stages, self.num_warps)

    def num_programs(self, m: int, n: int, num_sms: int = 132) -> int:
        """Programs to launch for an ``[m, n]`` output: the SM count, or one per tile."""
        tiles = -(-m // self.block_m) * -(-n // self.block_n)
        return min(num_sms, tiles) if self.persistent else tiles


def fp8_tiles(m: int, n: int, k: int, scaling: str, op: str = "all_reduce") -> Fp8Tiles:
    """The tile shape and launch for an fp8 ``[m, k] @ [k, n]`` of ``op`` with ``scaling`` in ``SCALINGS``
    (``"row"`` also for A per row with one B scale, as gathered tensor-wise shards give). Block-wise always takes
    ``block_k`` 128."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if scaling == "block":
        return Fp8Tiles(128, 128, 128, 8, 4, 8, True)
    stages = 4 if op == "all_gather" or k >= DEEP_PIPELINE_K else 3
    return Fp8Tiles(128, 256, 128, 8, stages, 8, True)


def fp8_plan(op: str, m: int, n: int, k: int, world_size: int, scaling: str, *, path: str = "nccl",
             num_sms: int = 132, comm_ratio: float | None = None, out_size: int = 2,
             cublas_block: bool = False) -> Plan:
    """The plan of an fp8 call before tuning: ``default_plan``'s overlap rules (``out_size``: the output dtype's bytes,
    ``comm_ratio``: the collective's time over the fp8 GEMM's) with ``fp8_tiles``' tiles. Block-wise on the NCCL path,
    where torch's block-wise kernel serves the shape (``cublas_block``), the GEMM is ``CUBLAS_BANDS`` groups of cuBLAS
    bands (``gemm="cublas"``): ours reached 0.36-0.77x of torch's there (h200x1-fp8-gemm.json)."""
    tiles = fp8_tiles(m, n, k, scaling, op)
    gemm = "cublas" if path == "nccl" and scaling == "block" and cublas_block else "triton"
    return default_plan(op, m, n, k, world_size, num_sms=num_sms, element_size=out_size, comm_ratio=comm_ratio,
                        tile=tiles.tile_config(), path=path, gemm=gemm,
                        num_groups=CUBLAS_BANDS if gemm == "cublas" else None)
