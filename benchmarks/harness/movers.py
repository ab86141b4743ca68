"""``python -m benchmarks.ops --movers``: how each way of moving bytes over NVLink and a cuBLAS GEMM slow each
other down (issue 4: which mover the P2P path should use).

Movers, each 64 MiB per call between this rank and the next one through symmetric memory: a copy engine pulling
from the peer (``cuMemcpyDtoDAsync``), and the SM copy kernel pulling from or pushing to the peer with 16 or 32
CTAs. For each: steady state (20 GEMMs of 8192^3 on one stream beside 20 mover calls on a high-priority stream,
per-call times alone and side by side) and single shots (one GEMM and one mover, the mover launched first or
second, against the two one after the other). All ranks run the same mover at the same time.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from benchmarks.harness.copy_kernel import sm_copy
from flashoverlap.comm import stream_ops
from flashoverlap.comm.symmetric import SymmetricWorkspace

MOVER_BYTES = 64 << 20
REPS = 20


def movers(device: torch.device, dtype: torch.dtype) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    peer = (rank + 1) % world_size
    gen = torch.Generator(device=device).manual_seed(7 + rank)
    a = torch.randn(8192, 8192, dtype=dtype, device=device, generator=gen)
    b = torch.randn(8192, 8192, dtype=dtype, device=device, generator=gen) / 8192**0.5
    workspace = SymmetricWorkspace(dist.group.WORLD, device)
    workspace.ensure(2 * MOVER_BYTES, "movers")
    workspace.local((2 * MOVER_BYTES,), torch.uint8).copy_(
        torch.randint(0, 256, (2 * MOVER_BYTES,), dtype=torch.uint8, device=device, generator=gen))
    local = torch.empty(MOVER_BYTES // 4, dtype=torch.int32, device=device)
    # Pulls read the second half of the peer's buffer, pushes write the first: no mover reads what another writes.
    pull_src = workspace.peer(peer)[MOVER_BYTES : 2 * MOVER_BYTES].view(torch.int32)
    push_dst = workspace.peer(peer)[:MOVER_BYTES].view(torch.int32)
    side = torch.cuda.Stream(device=device, priority=-(1 << 10))
    ways = {
        "copy engine pull": lambda: stream_ops.copy(side, local.data_ptr(), pull_src.data_ptr(), MOVER_BYTES),
        **{f"SM pull, {c} CTAs": (lambda c=c: sm_copy(local, pull_src, c)) for c in (16, 32)},
        **{f"SM push, {c} CTAs": (lambda c=c: sm_copy(push_dst, local, c)) for c in (16, 32)},
    }
    out = {}
    for name, move in ways.items():
        rec = {**_steady(lambda: torch.matmul(a, b), move, side), **_single(lambda: torch.matmul(a, b), move, side)}
        out[name] = rec
        if rank == 0:
            print(f"  {name:>18}: steady GEMM {rec['gemm_alone_ms']:.3f} -> {rec['gemm_beside_ms']:.3f} ms, "
                  f"mover {rec['mover_alone_ms']:.3f} -> {rec['mover_beside_ms']:.3f} ms; single shot: apart "
                  f"{rec['single_apart_ms']:.3f}, mover first {rec['single_mover_first_ms']:.3f}, GEMM first "
                  f"{rec['single_gemm_first_ms']:.3f} ms", flush=True)
    workspace.barrier(0)  # no rank frees its buffer while a peer still copies from it
    torch.cuda.synchronize()
    return out


def _spans(fn, side: torch.cuda.Stream) -> tuple[float, float, float]:
    """Run ``fn(events)`` with all ranks aligned; (main stream span, side stream span, whole span) in ms."""
    main = torch.cuda.current_stream()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    dist.barrier()
    torch.cuda.synchronize()
    ev[4].record()
    side.wait_stream(main)
    fn(ev)
    main.wait_stream(side)
    ev[5].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3]), ev[4].elapsed_time(ev[5])


def _median(fn, side, which: int, times: int = 3) -> float:
    return statistics.median(_spans(fn, side)[which] for _ in range(times))


def _steady(gemm, move, side) -> dict:
    def gemms(ev, reps=REPS):
        ev[0].record()
        for _ in range(reps):
            gemm()
        ev[1].record()

    def moves(ev, reps=REPS):
        with torch.cuda.stream(side):
            ev[2].record()
            for _ in range(reps):
                move()
            ev[3].record()

    gemm_alone = _median(lambda ev: (gemms(ev), ev[2].record(), ev[3].record()), side, 0)
    mover_alone = _median(lambda ev: (ev[0].record(), ev[1].record(), moves(ev)), side, 1)
    both = [_spans(lambda ev: (moves(ev), gemms(ev)), side) for _ in range(3)]
    return {"gemm_alone_ms": gemm_alone / REPS, "mover_alone_ms": mover_alone / REPS,
            "gemm_beside_ms": statistics.median(s[0] for s in both) / REPS,
            "mover_beside_ms": statistics.median(s[1] for s in both) / REPS}


def _single(gemm, move, side) -> dict:
    def apart(ev):
        gemm()
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            move()
        for e in ev[:4]:
            e.record()

    def mover_first(ev):
        with torch.cuda.stream(side):
            move()
        gemm()
        for e in ev[:4]:
            e.record()

    def gemm_first(ev):
        gemm()
        with torch.cuda.stream(side):
            move()
        for e in ev[:4]:
            e.record()

    return {f"single_{name}_ms": statistics.median(_spans(fn, side)[2] for _ in range(7))
            for name, fn in (("apart", apart), ("mover_first", mover_first), ("gemm_first", gemm_first))}
