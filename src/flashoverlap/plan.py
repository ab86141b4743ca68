"""The plan: the single contract between the tuner, the GEMM kernel and the communicators.

A plan describes one overlapped call completely and owns nothing else: the problem shape, the GEMM's tile shape
and launch configuration, the order in which output tiles are computed, and how that order is cut into
**groups**. A group is a run of consecutive tiles in that order that together fill one contiguous band of
full-width rows of the row-major output ``C[M, N]``; the communicator issues one collective per group, on exactly
that band, as soon as the group's counter says all of its tiles are stored. Plans are pure Python (no CUDA),
frozen, hashable and validated on construction.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from functools import cached_property

import numpy as np

OPS = ("all_reduce", "reduce_scatter", "all_gather")
# Ops whose M is split into world_size row blocks, one per rank, each tiled on its own.
BLOCKED_OPS = ("reduce_scatter", "all_gather")
# Which communicator consumes the plan: NCCL collectives on a stream, or copy engines and peer memory (P2P).
PLAN_PATHS = ("nccl", "p2p", "ring")
# The paths that run the ring of cuBLAS sub-bands (comm/ring_schedule.py): over copy engines, or over NCCL
# send/recv (comm/ring_nccl.py). Their plans have the same shape.
RING_PATHS = ("p2p", "ring")
# Who computes the groups: our signalling Triton GEMM, or cuBLAS band by band (the decomposition, as a plan: each
# group's rows one matmul, its collective issued as soon as that matmul is done; NCCL path only).
GEMMS = ("triton", "cublas")

# Counters live in one small per-device buffer; a plan may not use more groups than it holds.
MAX_GROUPS = 1024
# The P2P path (comm/ring_schedule.py): its flag header is laid out for up to this many ranks and sub-bands per
# rank block.
P2P_MAX_RANKS = 8
P2P_MAX_SUB_BANDS = 16


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch configuration of the GEMM.

    Tiles are ``block_m x block_n`` pieces of ``C``; the K loop steps ``block_k`` and is software-pipelined
    ``num_stages`` deep. Inside a group, tiles are visited in bands of ``group_m`` tile rows, column after
    column, so that the programs running at one time share rows of A and columns of B in L2.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            check_int(f"TileConfig.{name}", value, 16)
            if not _is_pow2(value) or value > 512:
                raise ValueError(f"TileConfig.{name} must be a power of two in [16, 512], got {value}")
        check_int("TileConfig.group_m", self.group_m, 1)
        check_int("TileConfig.num_stages", self.num_stages, 1)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}")

    def shared_bytes(self, itemsize: int) -> int:
        """Shared memory one program of the signalling GEMM holds with operands of ``itemsize`` bytes: ``num_stages``
        K slabs of A and of B (Triton 3.6 asked exactly this with pointer loads, and 8 bytes a stage more with TMA
        loads, its barriers: 294,936 for an fp8 tile of 128x256x128 in 3 stages run on bf16 operands). A tile made
        for fp8 is twice as large in bf16."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * itemsize


@dataclass(frozen=True)
class Group:
    """One run of consecutive tiles in the plan's tile order, and the rows they fill.

    ``row_start, row_end``: the group's rows of the result a rank receives: of ``C`` for all-reduce, of the rank's
    ``[M/W, N]`` block for reduce-scatter (the same band of every rank block). ``out_row_start``: where the group's
    contiguous slice of the GEMM's output begins (``C`` itself for all-reduce; for reduce-scatter a workspace laid
    out ``[group][W][rows][N]``, whose slice ``reduce_scatter_tensor`` turns into each rank's band); the slice
    spans ``blocks * rows`` rows, up to ``out_row_end``.
    """

    index: int
    tile_start: int  # position of the group's first tile in the tile order
    tile_count: int  # the value the group's counter reaches when the group is complete
    row_start: int
    row_end: int
    out_row_start: int = 0
    out_row_end: int = 0

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class Plan:
    """One overlapped ``op`` on a ``[m, k] @ [k, n]`` GEMM over ``world_size`` ranks.

    ``group_row_tiles[g]`` is the number of tile rows (``block_m`` rows of ``C`` each) in group ``g``, top to
    bottom; they sum to ``ceil(m / block_m)``. Inside a group, tiles are visited in bands of ``tile.group_m`` tile
    rows (fewer where the group has fewer left), so the L2-friendly order never straddles two groups.

    ``num_programs`` is how many programs (CTAs) the GEMM launches: fewer than the GPU's SMs leaves SMs free for
    the collectives' kernels; as many as there are tiles gives one tile per program, so that programs retire
    as they finish and the communication stream's kernels can take their SMs. ``comm_ctas`` sets the number of
    CTAs (channels) of NCCL's kernels (0 keeps NCCL's choice). ``sequential`` says overlap cannot pay at this
    shape: the op then runs the plain matmul followed by one collective on the whole result. ``path`` names the
    communicator the plan is for: ``"nccl"``, ``"p2p"`` (the ring over copy engines and peer-mapped memory, NVLink)
    or ``"ring"`` (the same ring over NCCL send/recv).
    """

    op: str
    m: int
    n: int
    k: int
    world_size: int
    tile: TileConfig = field(default_factory=TileConfig)
    group_row_tiles: tuple[int, ...] = ()
    num_programs: int = 132
    comm_ctas: int = 0
    sequential: bool = False
    path: str = "nccl"
    gemm: str = "triton"

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Plan.op must be one of {OPS}, got {self.op!r}")
        if self.path not in PLAN_PATHS:
            raise ValueError(f"Plan.path must be one of {PLAN_PATHS}, got {self.path!r}")
        if self.gemm not in GEMMS:
            raise ValueError(f"Plan.gemm must be one of {GEMMS}, got {self.gemm!r}")
        if self.path in RING_PATHS and self.gemm != "cublas" and not self.sequential:
            raise ValueError(f"Plan.gemm must be 'cublas' on the {self.path} path (cuBLAS multiplies every sub-band "
                             "there)")
        for name in ("m", "n", "k", "world_size", "num_programs"):
            check_int(f"Plan.{name}", getattr(self, name), 1)
        check_int("Plan.comm_ctas", self.comm_ctas, 0)
        if self.op in BLOCKED_OPS and self.m % self.world_size:
            raise ValueError(
                f"Plan.m = {self.m} must be divisible by world_size = {self.world_size} for {self.op} "
                "(each rank holds M / world_size rows)"
            )
        if not isinstance(self.tile, TileConfig):
            raise ValueError(f"Plan.tile must be a TileConfig, got {type(self.tile).__name__}")
        rows = tuple(self.group_row_tiles)
        object.__setattr__(self, "group_row_tiles", rows)
        if not rows:
            raise ValueError("Plan.group_row_tiles must name at least one group")
        for g, count in enumerate(rows):
            check_int(f"Plan.group_row_tiles[{g}]", count, 1)
        if sum(rows) != self.tiles_per_block:
            what = "ceil(m / block_m)" if self.blocks == 1 else "ceil(m / world_size / block_m), per rank block,"
            raise ValueError(
                f"Plan.group_row_tiles must sum to the number of tile rows {what} = {self.tiles_per_block}, "
                f"got {sum(rows)} from {rows}"
            )
        if len(rows) > MAX_GROUPS:
            raise ValueError(f"a plan may have at most {MAX_GROUPS} groups, got {len(rows)}")
        if self.path in RING_PATHS and not self.sequential:
            self._check_p2p(len(rows))
        object.__setattr__(self, "_hash", hash(self._fields()))

    # Hashed once: a plan keys the runtime's and the communicators' caches, several lookups per call, and the
    # generated hash of a dataclass rebuilds and hashes the tuple of every field (the tile's too) each time.
    def __hash__(self) -> int:
        return self._hash

    def _fields(self) -> tuple:  # what the generated __eq__ compares
        return tuple(getattr(self, item.name) for item in dataclass_fields(self))

    def __getstate__(self) -> dict:  # a string's hash differs between processes: never carry the cached one
        return {key: value for key, value in self.__dict__.items() if key != "_hash"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_hash", hash(self._fields()))

    def _check_p2p(self, groups: int) -> None:
        if self.world_size > P2P_MAX_RANKS:
            raise ValueError(f"the P2P path serves up to {P2P_MAX_RANKS} ranks, got world_size {self.world_size}")
        if self.op == "all_reduce" and groups % self.world_size:
            raise ValueError(
                f"a P2P all-reduce plan cuts C into world_size = {self.world_size} rank blocks of the same number "
                f"of groups (sub-bands): its group count must be a multiple of world_size, got {groups}"
            )
        per_block = groups // self.world_size if self.op == "all_reduce" else groups
        if per_block > P2P_MAX_SUB_BANDS:
            raise ValueError(f"a P2P plan may have at most {P2P_MAX_SUB_BANDS} sub-bands per rank block, got "
                             f"{per_block}")

    # -- serialization (the plan cache) ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan as plain JSON-able values; ``Plan.from_dict`` rebuilds (and re-validates) it."""
        return {"op": self.op, "m": self.m, "n": self.n, "k": self.k, "world_size": self.world_size,
                "tile": [self.tile.block_m, self.tile.block_n, self.tile.block_k, self.tile.group_m,
                         self.tile.num_stages, self.tile.num_warps],
                "group_row_tiles": list(self.group_row_tiles), "num_programs": self.num_programs,
                "comm_ctas": self.comm_ctas, "sequential": self.sequential, "path": self.path, "gemm": self.gemm}

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """A plan from ``to_dict``'s output; any missing or invalid field raises ``ValueError``."""
        try:
            fields = {key: data[key] for key in ("op", "m", "n", "k", "world_size", "group_row_tiles",
                                                 "num_programs", "comm_ctas", "sequential", "path")}
            tile = TileConfig(*data["tile"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a serialized Plan: {exc!r}") from None
        fields["group_row_tiles"] = tuple(fields["group_row_tiles"])
        fields["gemm"] = data.get("gemm", "triton")
        if not isinstance(fields["sequential"], bool):
            raise ValueError(f"Plan.sequential must be a bool, got {fields['sequential']!r}")
        return cls(tile=tile, **fields)

    # -- derived shape -------------------------------------------------------------------------------------
    # Cached (read on every call of a plan, by the communicators): a plan is frozen, so they never go stale.
    @cached_property
    def blocks(self) -> int:
        """Row blocks of ``C`` tiled separately: 1, or ``world_size`` for reduce-scatter and all-gather (one per
        rank's rows), so that no tile straddles two ranks' rows."""
        return self.world_size if self.op in BLOCKED_OPS else 1

    @cached_property
    def block_rows(self) -> int:
        return self.m // self.blocks

    @property
    def tiles_per_block(self) -> int:
        return math.ceil(self.block_rows / self.tile.block_m)

    @property
    def tiles_m(self) -> int:
        """Tile rows in all: ``blocks * tiles_per_block``; tile row ``p`` is tile row ``p % tiles_per_block`` of
        block ``p // tiles_per_block``."""
        return self.blocks * self.tiles_per_block

    @property
    def tiles_n(self) -> int:
        return math.ceil(self.n / self.tile.block_n)

    @property
    def num_tiles(self) -> int:
        return self.tiles_m * self.tiles_n

    @property
    def num_groups(self) -> int:
        return len(self.group_row_tiles)

    @property
    def counts_tiles(self) -> bool:
        """Whether the GEMM publishes each group's progress by bumping its counter per finished tile (a reduction's
        signalling Triton GEMM) and the communicator waits on those counters; else it waits on events (cuBLAS
        bands), on flags it raises itself (all-gather: communication is the producer), or on nothing (sequential)."""
        return self.op != "all_gather" and self.gemm != "cublas" and not self.sequential

    @property
    def sub_bands(self) -> int:
        """Sub-bands per rank block: the groups, or for a P2P all-reduce (whose ring cuts ``C`` into ``world_size``
        blocks of groups) the groups per block."""
        if self.path in RING_PATHS and self.op == "all_reduce" and not self.sequential:
            return self.num_groups // self.world_size
        return self.num_groups

    @property
    def grid_size(self) -> int:
        """Programs actually launched: never more than there are tiles."""
        return min(self.num_programs, self.num_tiles)

    @property
    def local_tiles(self) -> int:
        """Tiles computed before any group: for all-gather, the rank's own shard, which needs no communication;
        0 otherwise."""
        return self.tiles_per_block * self.tiles_n if self.op == "all_gather" else 0

    @cached_property
    def groups(self) -> tuple[Group, ...]:
        out = []
        tile_row = 0  # within a block
        # All-gather: a group is the band that arrives from the other ranks' shards (its own band was local).
        sources = self.blocks - 1 if self.op == "all_gather" else self.blocks
        for g, count in enumerate(self.group_row_tiles):
            row_start = tile_row * self.tile.block_m
            row_end = min((tile_row + count) * self.tile.block_m, self.block_rows)
            tile_start = self.local_tiles + sources * tile_row * self.tiles_n
            tile_count = sources * count * self.tiles_n
            out_row_start = self.blocks * row_start
            out_row_end = out_row_start + self.blocks * (row_end - row_start)
            out.append(Group(g, tile_start, tile_count, row_start, row_end, out_row_start, out_row_end))
            tile_row += count
        return tuple(out)

    # -- tile order --------------------------------------------------------------------------------------------
    def _band_tiles(self, block: int, first: int, count: int) -> np.ndarray:
        """Packed tiles of ``count`` tile rows of ``block`` from tile row ``first``, in bands of ``group_m`` rows
        visited column by column."""
        tiles_n, group_m = self.tiles_n, self.tile.group_m
        start = block * self.tiles_per_block + first
        out = []
        for band_start in range(start, start + count, group_m):
            height = min(group_m, start + count - band_start)
            local = np.arange(height * tiles_n, dtype=np.int64)
            out.append((band_start + local % height) * tiles_n + local // height)
        return np.concatenate(out)

    @functools.lru_cache(maxsize=64)  # noqa: B019  (plans are frozen and few; the cache holds a handful)
    def _order(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        order, owner = [], []
        firsts = np.cumsum((0,) + self.group_row_tiles[:-1])
        if self.op == "all_gather":
            # Own shard first (no wait), then each band as it arrives from rank+1, rank+2, ...
            for first, count in zip(firsts, self.group_row_tiles):
                order.append(self._band_tiles(rank, int(first), count))
            owner.append(np.full(self.local_tiles, -1, dtype=np.int64))
            blocks = [(rank + q) % self.world_size for q in range(1, self.world_size)]
        else:
            blocks = list(range(self.blocks))
        for grp, first, count in zip(self.groups, firsts, self.group_row_tiles):
            for block in blocks:
                order.append(self._band_tiles(block, int(first), count))
            owner.append(np.full(grp.tile_count, grp.index, dtype=np.int64))
        tables = (np.concatenate(order).astype(np.int32), np.concatenate(owner).astype(np.int32))
        for table in tables:
            table.flags.writeable = False
        return tables

    def tile_order(self, rank: int = 0) -> np.ndarray:
        """``[num_tiles]`` int32: the i-th tile computed is ``(v // tiles_n, v % tiles_n)`` for ``v = order[i]``.
        Only all-gather's order depends on the rank (its own shard first)."""
        return self._order(self._rank(rank))[0]

    def tile_groups(self, rank: int = 0) -> np.ndarray:
        """``[num_tiles]`` int32: the group of the i-th tile: the counter it increments (all-reduce,
        reduce-scatter), or the flag it waits for (all-gather; -1: a local tile, no wait)."""
        return self._order(self._rank(rank))[1]

    def _rank(self, rank: int) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return rank

    @cached_property
    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        bm = self.tile.block_m
        p = np.arange(self.tiles_m, dtype=np.int64)
        block, t = p // self.tiles_per_block, p % self.tiles_per_block
        c_row = block * self.block_rows + t * bm  # row of row-major C (and of A, for the row-scattered ops)
        valid = np.minimum(bm, self.block_rows - t * bm)
        group_of_t = np.repeat(np.arange(self.num_groups), self.group_row_tiles)[t]
        starts = np.array([g.row_start for g in self.groups], dtype=np.int64)[group_of_t]
        out_starts = np.array([g.out_row_start for g in self.groups], dtype=np.int64)[group_of_t]
        sizes = np.array([g.rows for g in self.groups], dtype=np.int64)[group_of_t]
        workspace_row = out_starts + block * sizes + (t * bm - starts)
        if self.op == "reduce_scatter":
            a_row, out_row = c_row, workspace_row
        elif self.op == "all_gather":
            a_row, out_row = workspace_row, c_row
        else:
            a_row, out_row = c_row, c_row
        tables = (a_row.astype(np.int32), out_row.astype(np.int32), valid.astype(np.int32))
        for table in tables:
            table.flags.writeable = False
        return tables

    def tile_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per tile row ``p`` (``[tiles_m]`` int32 each; tile row ``p`` is tile row ``p % tiles_per_block`` of
        rank block ``p // tiles_per_block``): the first row of A it reads, the first row of the GEMM's output it
        writes, and how many rows it has (``block_m``, fewer at the end of a block). All-reduce: both are rows of
        ``C``. Reduce-scatter: it writes the ``[group][W][rows][N]`` workspace. All-gather: it reads the gathered
        A, laid out ``[group][W][rows][K]`` as the per-group ``all_gather_into_tensor`` leaves it."""
        return self._rows

    # -- reporting ------------------------------------------------------------------------------------------
    def group_bytes(self, element_size: int) -> list[int]:
        """Bytes each group's collective moves: its slice of the GEMM's output, or for all-gather of the gathered A."""
        width = self.k if self.op == "all_gather" else self.n  # all-gather moves rows of A, the others of C
        return [(grp.out_row_end - grp.out_row_start) * width * element_size for grp in self.groups]

    def describe(self, element_size: int = 2) -> str:
        t = self.tile
        lines = [
            f"plan: {self.op} of [{self.m}, {self.k}] @ [{self.k}, {self.n}] over {self.world_size} ranks"
            + ("  (sequential: overlap cannot pay at this shape)" if self.sequential else ""),
            f"  tiles {t.block_m}x{t.block_n}x{t.block_k} (group_m {t.group_m}, {t.num_stages} stages, "
            f"{t.num_warps} warps): {self.tiles_m} x {self.tiles_n} = {self.num_tiles} tiles, "
            f"{self.grid_size} programs, "
            + ("bands computed by cuBLAS, " if self.gemm == "cublas" and self.path == "nccl" else "")
            + (f"{self.path} ring: {self.sub_bands} cuBLAS sub-band(s) per rank block, "
               + ("copy engines" if self.path == "p2p" else "NCCL send/recv") if self.path in RING_PATHS
               else
               f"NCCL CTAs {'default' if self.comm_ctas == 0 else self.comm_ctas}"),
        ]
        where = "" if self.blocks == 1 else f" of each of the {self.blocks} rank blocks"
        for grp, nbytes in zip(self.groups, self.group_bytes(element_size)):
            lines.append(
                f"  group {grp.index:3d}: tiles [{grp.tile_start}, {grp.tile_start + grp.tile_count}) "
                f"-> rows [{grp.row_start}, {grp.row_end}){where}, {nbytes / 2**20:.2f} MiB"
            )
        return "\n".join(lines)


# SMs a GEMM leaves to NCCL in communication-bound plans, and in every all-gather plan (whose GEMM waits for NCCL):
# through host memory NCCL made no progress beside a GEMM that left it 16 SMs (reduce-scatter sweep, 8 or 16
# CTAs) but overlapped with 32; the one all-gather configuration that stalled the benchmark (8192x28672x8192,
# pcie-like) left only its 16 CTAs' SMs.
NCCL_FREE_SMS = 32


def nccl_free_sms(num_sms: int, comm_ctas: int) -> int:
    """SMs an all-gather GEMM must leave free for NCCL (deadlock rule 2): the CTAs, and ``NCCL_FREE_SMS`` where the
    GPU is large enough for that to leave the GEMM three quarters of it."""
    return max(comm_ctas, min(NCCL_FREE_SMS, num_sms // 4))
