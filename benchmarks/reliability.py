"""The GPU reliability run: many calls at random, each checked against plain PyTorch, then faults.

    torchrun --nproc-per-node 2 benchmarks/reliability.py [--calls 10000] [--out reliability.json]

1. ``--calls`` calls chosen at random (the same choices on every rank): op, path (``auto``, ``nccl``, ``p2p``),
   dtype, ``b`` as ``w.t()`` or not, ``M`` from 1 to 16384 (odd and round), ``N`` and ``K``, on the world group
   or on a second group of the same ranks; inputs are fresh random slices of a large random pool, outputs
   NaN-poisoned every 50 calls; each result compared with ``matmul`` + the NCCL collective. Between them, plain
   NCCL all-reduces on the same group, checked. GPU memory allocated is sampled after warm-up (every op, path and
   dtype at the largest shape first), every 1000 calls and at the end, each time with no call's tensors alive: it
   is flat if no sample exceeds the warm-up's by more than 64 MiB.
2. Faults, in debug mode (``FLASHOVERLAP_DEBUG_TIMEOUT``), each on a fresh group, for every op and path: one rank
   skips the call, or raises before it: the other rank must get a Python error naming its rank, the op and the
   group within the timeout (plus a margin), not hang; ranks that disagree on the dtype or on M: every rank must
   get an error before anything is launched.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import time

import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap import settings
from flashoverlap.runtime.context import existing_context
from flashoverlap.testing import plain

OPS = fo.ops.GEMM_OPS
M_CHOICES = [1, 2, 7, 16, 127, 128, 500, 1000, 1023, 2048, 3001, 4096, 6000, 8191, 8192, 12288, 16384]
NK_CHOICES = [64, 255, 512, 1000, 1024, 2048, 3000, 4096]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def operands(pools, start, dtype, rows, n, k, transposed):
    """``a [rows, K]`` and ``b [K, N]`` (``w.t()`` or contiguous): views of the random pool from ``start``."""
    pool = pools[dtype]
    a = pool[start : start + rows * k].view(rows, k)
    w = pool[start + rows * k : start + rows * k + n * k].view(n, k) / k**0.5
    return a, (w.t() if transposed else w.t().contiguous())


def random_calls(args, rank, world, device, log) -> dict:
    rng = random.Random(args.seed)  # the same sequence of choices on every rank
    rng_local = random.Random(args.seed * 1000 + rank + 1)
    second = dist.new_group(list(range(world)))
    pools = {dt: torch.randn(160 << 20, dtype=dt, device=device) for dt in TOLERANCE}
    failures, checked, plain_checked = [], 0, 0
    # Warm-up: every op, path and dtype at the largest shape, so that workspaces reach their size first.
    for op in OPS:
        for path in ("auto", "nccl", "p2p"):
            for dtype in TOLERANCE:
                for group in (None, second):
                    m = max(M_CHOICES)
                    a, b = operands(pools, 0, dtype, m // world if op == "all_gather" else m, 4096, 4096, True)
                    OPS[op](a, b, group, path=path)
    torch.cuda.synchronize()
    memory = {"after_warmup": torch.cuda.memory_allocated(device), "samples": []}
    start = time.time()
    last = None
    for call in range(args.calls):
        if last is not None and rng.random() < 0.25:
            # The last call again on the same tensors, whose values change in place: the P2P path replays it
            # from a CUDA graph (comm/replay.py) once it repeats, and must read the new values.
            op, path, dtype, transposed, group, (m, n, k), rows, start = last
            pools[dtype][start : start + rows * k].neg_()
        else:
            op, path = rng.choice(list(OPS)), rng.choice(["auto", "nccl", "p2p"])
            dtype, transposed = rng.choice(list(TOLERANCE)), rng.random() < 0.5
            group = second if rng.random() < 0.1 else None
            m, n, k = rng.choice(M_CHOICES), rng.choice(NK_CHOICES), rng.choice(NK_CHOICES)
            if op != "all_reduce":
                m = max(world, -(-m // world) * world)
            rows = m // world if op == "all_gather" else m
            start = rng_local.randrange(0, pools[dtype].numel() - rows * k - n * k)
            if call % 50 == 0:
                torch.full((1 << 28,), float("nan"), dtype=torch.float16, device=device)  # poison the allocator
        last = (op, path, dtype, transposed, group, (m, n, k), rows, start)
        failure = checked_call(pools, start, op, path, dtype, transposed, group, (m, n, k), rows)
        checked += 1
        if failure is not None:
            failures.append({"call": call, **failure})
        if call % 5 == 0:  # a plain collective on the same group between the ops
            if not plain_all_reduce_ok(1000 + call % 7, rank, world, device, group):
                failures.append({"call": call, "plain_all_reduce": "wrong"})
            plain_checked += 1
        if (call + 1) % 1000 == 0:
            memory["samples"].append(torch.cuda.memory_allocated(device))  # no call's tensors are alive here
            log(f"{call + 1} calls, {len(failures)} failures, {time.time() - start:.0f} s, "
                f"{memory['samples'][-1] / 2**20:.0f} MiB allocated")
    torch.cuda.synchronize()
    memory["end"] = torch.cuda.memory_allocated(device)
    memory["max_allocated"] = torch.cuda.max_memory_allocated(device)
    highest = max(memory["samples"] + [memory["end"]])
    contexts = [existing_context(g, device) for g in (dist.group.WORLD, second)]
    replays = sum(ctx.communicators[("gemm", "p2p")].graphs.replays for ctx in contexts
                  if ctx is not None and ("gemm", "p2p") in ctx.communicators)
    counts = torch.tensor([checked, len(failures), plain_checked, replays], device=device)
    dist.all_reduce(counts)
    return {"calls": args.calls, "checked_all_ranks": int(counts[0]), "failures_all_ranks": int(counts[1]),
            "plain_collectives_checked": int(counts[2]), "p2p_calls_replayed_all_ranks": int(counts[3]),
            "failures": failures[:20], "memory_bytes": memory,
            "memory_flat": highest <= memory["after_warmup"] + (64 << 20), "seconds": time.time() - start}


def checked_call(pools, start, op, path, dtype, transposed, group, shape, rows) -> dict | None:
    """One call compared with plain PyTorch: None if right, else what went wrong. Its tensors die on return, so
    that memory sampled between calls holds none of them."""
    m, n, k = shape
    a, b = operands(pools, start, dtype, rows, n, k, transposed)
    got = OPS[op](a, b, group, path=path)
    want = plain(op, a, b, group)
    err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    nan = bool(torch.isnan(got).any())
    if nan or not err < TOLERANCE[dtype]:
        return {"op": op, "path": path, "dtype": str(dtype), "shape": [m, n, k],
                "group": "second" if group is not None else "world", "rel_err": err, "nan": nan}
    return None


def plain_all_reduce_ok(numel, rank, world, device, group) -> bool:
    x = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(x, group=group)
    return bool(torch.all(x == world * (world + 1) / 2))


SCENARIOS = [(op, path, kind) for op in OPS for path in ("nccl", "p2p") for kind in ("skip", "raise", "dtype", "shape")]


def faults(args, rank, world, device, log) -> list[dict]:
    """The fault scenarios (``--fault OP:PATH:KIND`` picks one). After a rank's missing-peer error the abandoned
    collective's NCCL kernel keeps running on the GPU, so the next scenario's device-wide synchronisation would
    wait behind it: run one scenario per process (``benchmarks/device_run.sh``'s ``faults`` step does)."""
    os.environ["FLASHOVERLAP_DEBUG_TIMEOUT"] = str(args.fault_timeout)
    settings.refresh()
    control = dist.new_group(list(range(world)), backend="gloo")  # stays healthy while the tested groups break
    results = []
    chosen = SCENARIOS if args.fault is None else [tuple(args.fault.split(":"))]
    for op, path, kind in chosen:
        group = dist.new_group(list(range(world)))
        m, n, k = 4096, 2048, 1024
        rows = m // world if op == "all_gather" else m
        a = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
        b = torch.randn(k, n, dtype=torch.bfloat16, device=device)
        OPS[op](a, b, group, path=path)  # warm: the group's state, plan cache, kernels
        torch.cuda.synchronize()
        dist.barrier(group=control)
        outcome, start = "returned", time.monotonic()
        try:
            if kind in ("skip", "raise") and rank == world - 1:
                if kind == "raise":
                    raise KeyError("this rank failed before its call")
                outcome = "skipped the call"
            else:
                if kind == "dtype" and rank == world - 1:
                    a, b = a.half(), b.half()
                if kind == "shape" and rank == world - 1:
                    a = a[: rows - world]
                OPS[op](a, b, group, path=path)
        except KeyError:
            outcome = "raised before the call"
        except (RuntimeError, ValueError) as exc:
            outcome = f"{type(exc).__name__}: {str(exc)[:240]}"
        elapsed = time.monotonic() - start
        dist.barrier(group=control)
        everyone = [None] * world
        dist.all_gather_object(everyone, {"rank": rank, "outcome": outcome, "seconds": round(elapsed, 2)},
                               group=control)
        if kind in ("skip", "raise"):
            waiter = everyone[0]
            ok = (waiter["outcome"].startswith("RuntimeError") and "rank 0: " in waiter["outcome"]
                  and "group" in waiter["outcome"] and waiter["seconds"] < args.fault_timeout + 5)
        else:
            ok = all(r["outcome"].startswith("ValueError") and "disagree" in r["outcome"] for r in everyone)
        results.append({"op": op, "path": path, "fault": kind, "ok": ok, "ranks": everyone})
        log(f"fault {kind:>5} {op:>14} {path:>4}: {'OK' if ok else 'NOT OK'} {everyone[0]['outcome'][:120]}")
    return results


def _scenario(text: str) -> str:
    """``--fault``: one of ``SCENARIOS`` as OP:PATH:KIND (a misspelt kind made a normal call, recorded NOT OK)."""
    if tuple(text.split(":")) not in SCENARIOS:
        raise argparse.ArgumentTypeError(f"not a scenario: {text!r}; OP one of {', '.join(OPS)}, PATH nccl or p2p, "
                                         "KIND skip, raise, dtype or shape")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fault-timeout", type=float, default=5.0)
    parser.add_argument("--skip-faults", action="store_true")
    parser.add_argument("--fault", default=None, metavar="OP:PATH:KIND", type=_scenario,
                        help="only this fault scenario (KIND: skip, raise, dtype, shape), and no random calls")
    parser.add_argument("--out", default="reliability.json")
    args = parser.parse_args()
    if args.calls < 1:  # --skip-faults with no calls would check nothing and exit 0
        parser.error("--calls takes a positive count")
    if args.fault is not None and args.skip_faults:  # one scenario and no faults: the file would hold only meta
        parser.error("--fault runs one fault scenario and --skip-faults runs none: give one of them")
    # results_file.require_cuda's line, inline: torchrun runs this file as a script, without the checkout on its path
    gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 2))  # one per rank
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < gpus:
        raise SystemExit(f"benchmarks/reliability.py: needs {gpus} CUDA GPU{'s' if gpus > 1 else ''}, one per rank "
                         f"(torchrun --nproc-per-node N), found {found or 'none'}: run it on a GPU machine, as its "
                         "docstring shows")
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()

    def log(text):
        if dist.get_rank() == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    report = {"meta": {"gpus": f"{world}x {torch.cuda.get_device_name()}", "torch": torch.__version__,
                       "commit": os.environ.get("FLASHOVERLAP_COMMIT", "unknown"),
                       "command": f"torchrun --nproc-per-node {world} benchmarks/reliability.py --calls {args.calls}",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}}
    if args.fault is None:
        report["random_calls"] = random_calls(args, rank, world, device, log)
        log(json.dumps({k: v for k, v in report["random_calls"].items() if k != "failures"}))
    if not args.skip_faults:
        report["faults"] = faults(args, rank, world, device, log)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}", flush=True)
    os._exit(0)  # the fault groups hold collectives that never complete: no orderly shutdown


if __name__ == "__main__":
    main()
