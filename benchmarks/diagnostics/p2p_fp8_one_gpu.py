"""The P2P path's fp8 calls on ONE GPU shared by two processes (``p2p_one_gpu.py``'s set-up: a gloo group, the
workspace shared by CUDA IPC, the communicator called with ``Call``s as the runtime calls it): a check of the
mechanics, not a performance figure.

Every op x tensor/row/block scales x bf16 output with a bias / fp32 output without, ``b`` as ``w.t()`` (cuBLAS's
``_scaled_mm``) and, at the small shape, row-major (the dequantised product), eager calls and replayed ones (the
second identical call is captured, the third on replayed), each checked against the sequential path's result
computed locally (``comm/scaled.scaled_mm`` of each rank's operands, summed in fp32; all-gather: of the gathered
operands with every shard's own scales), outputs poisoned with NaN after each check, the gathered fp8 rows and
scales compared byte for byte. Then the host time to issue one call, fp8 (row-wise) beside bf16, eager and
replayed, interleaved. Prints "checked N" and exits non-zero on any mismatch.

CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 2 -m benchmarks.diagnostics.p2p_fp8_one_gpu [out.json]
"""

import sys
import traceback

import torch

import flashoverlap as fo
from benchmarks.diagnostics.p2p_one_gpu import close_run, ipc_p2p, open_run
from benchmarks.diagnostics.results_file import require_cuda
from benchmarks.harness.timing import host_us_interleaved
from benchmarks.shared.calls import quantise
from flashoverlap.comm import scaled
from flashoverlap.comm.protocol import Call

SHAPES = [(1002, 1008, 1024), (4096, 4096, 4096)]  # (M, N, K): M even (W = 2), N and K multiples of 16
HOST_SHAPE = (4096, 8192, 8192)
HOST_ROUNDS = 60
OPS = ("reduce_scatter", "all_reduce", "all_gather")
MODES = ("tensor", "row", "block")


def operands(op, m, n, k, world, mode, out_dtype, with_bias, transposed, seed):
    """Every rank's (a, b, Scales), made from one seed on every rank (all-gather: the shards of one A, one b)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = m // world if op == "all_gather" else m
    per_rank = []
    for rank in range(world):
        a, sa = quantise(torch.randn(rows, k, device="cuda", generator=gen) * (1 + rank), mode, "a")
        if op == "all_gather" and rank:
            b, sb, bias = per_rank[0][1], per_rank[0][2].b, per_rank[0][2].bias
        else:
            w = torch.randn(n, k, device="cuda", generator=gen)
            b, sb = quantise(w.t().contiguous(), mode, "b")  # [K, N] row-major, then laid out as asked
            b = b.t().contiguous().t() if transposed else b
            bias = torch.randn(n, device="cuda", generator=gen).to(out_dtype) if with_bias else None
        per_rank.append((a, b, scaled.Scales.of(sa, sb, out_dtype, bias)))
    return per_rank


def sequential(op, per_rank, rank, world):
    """What the sequential path returns on ``rank`` (``comm/tp/sequential._scaled``), computed locally."""
    if op == "all_gather":
        a_full = torch.cat([a for a, _, _ in per_rank])
        scale_full = torch.cat([s.rows_of_a(slice(0, a.shape[0]), a.shape[0]) for a, _, s in per_rank])
        _, b, s0 = per_rank[0]
        return scaled.scaled_mm(a_full, b, s0, scale_full), (a_full, scale_full)
    total = sum(scaled.scaled_mm(a, b, s).float() for a, b, s in per_rank).to(per_rank[0][2].out_dtype)
    if op == "reduce_scatter":
        rows = total.shape[0] // world
        total = total[rank * rows : (rank + 1) * rows]
    return total, None


def check(got, want, what):
    nan = bool(torch.isnan(got).any())
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    limit = 1e-2 if got.dtype == torch.bfloat16 else 2e-3
    if nan or err >= limit or got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{what}: nan={nan} rel_err={err:.2e} dtype={got.dtype} shape={tuple(got.shape)}")
    return err


def host_rows(comm, rank, world):
    """Host time per call at ``HOST_SHAPE``: fp8 (row-wise, bf16 output) beside bf16, eager and replayed."""
    m, n, k = HOST_SHAPE
    rows = []
    for op in OPS:
        plan = fo.default_plan(op, m, n, k, world, path="p2p", allow_sequential=False)
        shard = m // world if op == "all_gather" else m
        a16 = torch.randn(shard, k, dtype=torch.bfloat16, device="cuda")
        b16 = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()
        a8, sa = quantise(a16.float(), "row", "a")
        b8, sb = quantise(b16.float(), "row", "b")
        b8 = b8.t().contiguous().t()
        scales = scaled.Scales.of(sa, sb)
        calls = {f"{dtype} {mode}": Call(op, plan, *((a8, b8) if dtype == "fp8" else (a16, b16)), replay=replay,
                                         scales=scales if dtype == "fp8" else None)
                 for dtype in ("bf16", "fp8") for mode, replay in (("eager", False), ("replayed", True))}
        for call in calls.values():  # kernels loaded, graphs captured: the timed calls are the steady ones
            comm.run(call)
            comm.run(call)
        torch.cuda.synchronize()
        us = host_us_interleaved({name: lambda call=call: comm.run(call) for name, call in calls.items()},
                                 calls=HOST_ROUNDS, pairs=(("fp8 eager", "bf16 eager"),
                                                           ("fp8 replayed", "bf16 replayed")))
        for name in calls:
            rows.append({"op": op, "call": name, "M": m, "N": n, "K": k, "host_us": round(us[name], 1)})
        rows.append({"op": op, "fp8 - bf16 eager us": round(us["fp8 eager - bf16 eager"], 1),
                     "fp8 - bf16 replayed us": round(us["fp8 replayed - bf16 replayed"], 1)})
        if rank == 0:
            print(f"host {op}: " + ", ".join(f"{name} {us[name]:.1f} us" for name in calls), flush=True)
    return rows


class ReplayShortfall(AssertionError):
    """A case's repeated calls replayed fewer graphs than the runtime's rule gives (correct results, more host time)."""


SIGNATURE_FIELDS = ("plan", "a dtype", "a address", "a shape", "a strides", "b address", "b shape", "b strides",
                    "out address", "gathered address", "workspace address", "cuBLAS switches", "hook", "fp8 scales")


def moved(signatures: list[tuple]) -> str:
    """Which parts of consecutive replay signatures differed (what kept a repeated call from its graph)."""
    changes = []
    for before, after in zip(signatures, signatures[1:]):
        changes.append([name for name, x, y in zip(SIGNATURE_FIELDS, before, after) if x != y]
                       + ([f"scales part {i}" for i, (x, y) in enumerate(zip(before[-1], after[-1])) if x != y]
                          if before[-1] is not None and after[-1] is not None else []))
    return f"signature changes between the replayed calls: {changes}"


def main():
    rank, world, device, meta = open_run("p2p_fp8_one_gpu")
    comm = ipc_p2p(device)
    signatures = []
    signature_of = comm._signature

    def recording(*args, **kwargs):  # every replay signature the communicator computes, in order
        signatures.append(signature_of(*args, **kwargs))
        return signatures[-1]

    comm._signature = recording
    report = {"meta": meta, "checked": 0, "worst": {}, "failures": []}
    for op in OPS:
        for i, (m, n, k) in enumerate(SHAPES):
            for mode in MODES:
                for out_dtype, with_bias in ((torch.bfloat16, True), (torch.float32, False)):
                    for transposed in (True, False) if i == 0 else (True,):
                        per_rank = operands(op, m, n, k, world, mode, out_dtype, with_bias, transposed, 7 * i + 1)
                        a, b, scales = per_rank[rank]
                        what = (f"{op} {m}x{n}x{k} {mode} {str(out_dtype)[6:]} bias={with_bias} "
                                f"b{'.t()' if transposed else ''}")
                        try:
                            want, gathered_want = sequential(op, per_rank, rank, world)
                        except RuntimeError as error:  # torch refuses this combination: said, not counted
                            report["failures"].append(f"{what}: the sequential reference raised {error}")
                            print(f"rank {rank}: {what}: reference raised: {str(error)[:200]}", flush=True)
                            continue
                        plan = fo.default_plan(op, m, n, k, world, path="p2p", allow_sequential=False)
                        try:
                            for replay in (False, True):
                                replays = comm.graphs.replays
                                for call in range(3):
                                    label = f"{what} replay={replay} #{call}"
                                    got, gathered = comm.run(Call(op, plan, a, b, op == "all_gather", replay=replay,
                                                                  scales=scales))
                                    torch.cuda.synchronize()
                                    err = check(got, want, label)
                                    report["worst"][what] = max(report["worst"].get(what, 0.0), err)
                                    if op == "all_gather":
                                        a_full, scale_full = gathered
                                        if not (a_full.is_contiguous() and scale_full.is_contiguous()
                                                and torch.equal(a_full.view(torch.uint8),
                                                                gathered_want[0].view(torch.uint8))
                                                and torch.equal(scale_full, gathered_want[1].contiguous())):
                                            raise AssertionError(f"{label}: the gathered rows or scales differ")
                                    got.fill_(float("nan"))
                                    del got, gathered  # the next call gets the same memory back
                                    report["checked"] += 1
                                if replay and comm.graphs.replays - replays < 2:
                                    raise ReplayShortfall(f"{what}: {comm.graphs.replays - replays} replays of 3 "
                                                          f"calls; {moved(signatures[-3:])}")
                        except (RuntimeError, ReplayShortfall) as error:  # recorded; the run goes on
                            report["failures"].append(f"{what}: {error}")
                            print(f"rank {rank}: FAILED {what}: {str(error)[:300]}", flush=True)
        print(f"rank {rank}: {op}: correct, eager and replayed ({report['checked']} calls so far, "
              f"{comm.graphs.captures} captures, {comm.graphs.replays} replays)", flush=True)
    print(f"rank {rank}: checked {report['checked']}, {len(report['failures'])} cases failed", flush=True)
    report["rows"] = host_rows(comm, rank, world)
    close_run(report, rank)
    if report["failures"]:
        raise RuntimeError(f"{len(report['failures'])} cases failed: {report['failures'][:3]}")


if __name__ == "__main__":
    require_cuda("benchmarks.diagnostics.p2p_fp8_one_gpu", path_only=True)  # before the try: one line
    try:
        main()
    except BaseException as error:
        traceback.print_exc()
        print(f"FAILED: {type(error).__name__}: {error}", flush=True)
        sys.exit(1)
