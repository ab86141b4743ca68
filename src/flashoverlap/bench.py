"""``flashoverlap bench ops`` (under ``torchrun --nproc-per-node W``): the three ops against the plain PyTorch code
they replace, matmul then the collective, at docs/benchmarks.md's grid shapes, through the public API only.

Per op and shape, timed side by side (``tune.timing.time_side_by_side``: CUDA events, each call queued behind a GPU
sleep, calls interleaved, median per rank, maximum over ranks): T_gemm (``torch.matmul``), T_comm (the collective
alone), T_seq (matmul then the collective), T (the op as a user calls it: no plan, ``path="auto"``, untuned: the
command line turns the plan cache off, ``FLASHOVERLAP_NO_CACHE=1``), T_ideal = max(T_gemm, T_comm), the speedup
T_seq / T and E = (T_seq - T) / (T_seq - T_ideal), the share of the hideable time that the op hid; and the host time
to issue one call of T_seq and of T. Rank 0 prints a table per op; ``--out FILE``
also writes ``{"meta", "rows"}``.

The full harness is the top-level ``benchmarks/`` of a source checkout, not installed; from its root:
``torchrun --nproc-per-node 2 -m benchmarks.ops`` (these rows, plus our GEMM alone, the decomposition and async TP
baselines, both paths side by side, the hand-set plan beside a tuned one, plan sweeps, interference and movers, the
timeline picture), ``-m benchmarks.block`` (the transformer block) and ``-m benchmarks.moe`` (the MoE layer);
``flashoverlap bench block`` and ``bench moe`` run them there. The harness builds on the pieces here.

``python -m flashoverlap.bench OPTIONS`` is ``flashoverlap bench ops OPTIONS``; the harness's own options
(``--timeline``, ...) hand the run to ``benchmarks.ops``. (The two-GPU results files record that spelling from when it
ran the whole harness: ``benchmarks.ops`` runs what wrote them now.)
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.ops import GEMM_OPS
from flashoverlap.tune.timing import inputs, time_side_by_side

GRID_ALL_REDUCE = [(4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 4096), (8192, 8192, 14336),
                   (2048, 8192, 14336)]
GRIDS = {"all_reduce": GRID_ALL_REDUCE, "reduce_scatter": GRID_ALL_REDUCE,
         "all_gather": [(4096, 8192, 8192), (8192, 14336, 8192), (16384, 8192, 8192), (8192, 28672, 8192)]}
OP_FUNCTIONS = GEMM_OPS  # the name the harness has used
# torch >= 2.13 deprecates the *_tensor names for *_single, which older torch does not have.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shape_problem(ops: list[str], shapes: list[tuple[int, int, int]] | None, world_size: int) -> str | None:
    """Why ``bench ops`` cannot run ``shapes`` (else each op's grid) over ``world_size`` ranks, in one line (None
    where it can): reduce-scatter and all-gather split M over the ranks."""
    for op in ops:
        for m, n, k in shapes or GRIDS[op]:
            if op != "all_reduce" and m % world_size:
                which = "--shapes" if shapes else "the grid's shape"
                return (f"{which} {m},{n},{k}: {OP_NAMES[op]} needs M divisible by the {world_size} ranks; pass "
                        "--shapes with such M")
    return None


def ranks_beyond_gpus() -> tuple[int, int] | None:
    """``(ranks on this node, CUDA GPUs)`` where torchrun started more ranks on this node (``LOCAL_WORLD_SIZE``) than
    it has GPUs, one per rank (a rank past the last GPU fails in ``torch.cuda.set_device`` while the others wait in
    the rendezvous); None where each has one, or outside torchrun. Its callers word the refusal."""
    local, gpus = os.environ.get("LOCAL_WORLD_SIZE", ""), torch.cuda.device_count()
    if local.isascii() and local.isdigit() and int(local) > gpus:
        return int(local), gpus
    return None


def out_problem(path: str | None) -> str | None:
    """Why ``--out PATH`` could not be written once the run is over (rank 0 writes it last, ``write_results``), in
    one line (None where it can, or without ``--out``): a directory, a folder that is a file, one not writable."""
    if path is None:
        return None
    if os.path.isdir(path):
        return f"--out {path}: is a directory; name the results file"
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):  # write_results creates the missing folders under the nearest that exists
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"--out {path}: {folder} is a file, not a folder"
    target = path if os.path.exists(path) else folder
    if not os.access(target, os.W_OK):
        return f"--out {path}: {target} is not writable"
    return None


def efficiency(t_seq: float, t: float, t_ideal: float) -> float:
    """docs/benchmarks.md's E: the share of the hideable time ``t_seq - t_ideal`` that ``t`` hid."""
    return (t_seq - t) / (t_seq - t_ideal) if t_seq > t_ideal else float("nan")


def calls(op: str, shape: tuple[int, int, int], dtype: torch.dtype, group: dist.ProcessGroup | None = None,
          device: torch.device | str = "cuda") -> tuple[torch.Tensor, torch.Tensor, dict[str, Callable[[], object]]]:
    """This rank's fresh random operands of ``op`` at ``shape = (M, N, K)`` (all-gather: its shard of A's M rows;
    b an nn.Linear weight's transposed view) and the calls a row times: ``gemm``, ``comm``, ``seq`` (the plain
    PyTorch code the op replaces) and ``ours`` (the op as a user calls it)."""
    m, n, k = shape
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    a, b = inputs(m // world if op == "all_gather" else m, n, k, dtype, rank, device)
    if op == "all_reduce":
        c = torch.matmul(a, b)

        def comm():
            dist.all_reduce(c, group=group)

        def seq():
            dist.all_reduce(torch.matmul(a, b), group=group)
    elif op == "reduce_scatter":
        c = torch.matmul(a, b)
        out = torch.empty((m // world, n), dtype=dtype, device=a.device)

        def comm():
            _reduce_scatter(out, c, group=group)

        def seq():
            _reduce_scatter(out, torch.matmul(a, b), group=group)
    else:
        c = torch.empty((m, k), dtype=dtype, device=a.device)  # the gathered A

        def comm():
            _all_gather(c, a, group=group)

        def seq():
            comm()
            return torch.matmul(c, b)
    gathered = c if op == "all_gather" else a
    fn = OP_FUNCTIONS[op]
    return a, b, {"gemm": lambda: torch.matmul(gathered, b), "comm": comm, "seq": seq,
                  "ours": lambda: fn(a, b, group)}


def op_row(op: str, shape: tuple[int, int, int], dtype: torch.dtype, t: dict[str, float],
           host_us: dict[str, float] | None = None) -> dict:
    """One results row in docs/benchmarks.md's columns from the side-by-side medians ``t`` (``gemm``, ``comm``,
    ``seq``, ``ours``) and the host time per call ``host_us`` (of ``seq`` and ``ours``, where measured)."""
    m, n, k = shape
    t_ideal = max(t["gemm"], t["comm"])
    return {"op": op, "dtype": str(dtype).replace("torch.", ""), "M": m, "N": n, "K": k, "t_gemm_ms": t["gemm"],
            "t_comm_ms": t["comm"], "t_seq_ms": t["seq"], "t_ms": t["ours"], "t_ideal_ms": t_ideal,
            "speedup": t["seq"] / t["ours"], "E": efficiency(t["seq"], t["ours"], t_ideal),
            "host_us": {name: host_us[name] for name in ("seq", "ours") if name in host_us} if host_us else None}


def bench_rows(ops: list[str], shapes: list[tuple[int, int, int]] | None, dtype: torch.dtype, timer: Callable,
               group: dist.ProcessGroup | None = None, device: torch.device | str = "cuda",
               log: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """A row per op and shape (``shapes``, else each op's grid). ``timer(fns, host_us) -> {name: ms}``:
    ``time_side_by_side`` on the GPU, a stand-in on the CPU (the CPU suite checks the rows this way); ``log(rows)``
    after each row."""
    rows: list[dict] = []
    for op in ops:
        for shape in shapes or GRIDS[op]:
            _, _, fns = calls(op, shape, dtype, group, device)
            host: dict[str, float] = {}
            rows.append(op_row(op, shape, dtype, timer(fns, host), host))
            if log is not None:
                log(rows)
    return rows


def ms(value: float | None) -> str:
    return f"{value:7.3f}" if isinstance(value, float) else f"{'-':>7}"


def host_cell(row: dict) -> str:
    return "{seq:.0f}/{ours:.0f}".format(**row["host_us"]) if row.get("host_us") else "-"


# A table's columns after the shape: (header, width, cell of a row).
COLUMNS = [("T_gemm", 7, lambda r: ms(r["t_gemm_ms"])), ("T_comm", 7, lambda r: ms(r["t_comm_ms"])),
           ("T_seq", 7, lambda r: ms(r["t_seq_ms"])), ("T", 7, lambda r: ms(r["t_ms"])),
           ("T_ideal", 7, lambda r: ms(r["t_ideal_ms"])), ("speedup", 7, lambda r: f"{r['speedup']:7.2f}"),
           ("E", 6, lambda r: f"{r['E']:+6.2f}"), ("host us seq/ours", 16, host_cell)]


def print_table(title: str, rows: list[dict], columns: list[tuple[str, int, Callable[[dict], str]]] = COLUMNS):
    """``title``, a header and a line per row: the shape, then each column's cell, right-aligned to its width."""
    print(f"\n{title}")
    print(f"{'M x N x K':>20} " + " ".join(f"{header:>{width}}" for header, width, _ in columns))
    for r in rows:
        print(f"{r['M']:>6}x{r['N']:>6}x{r['K']:>6} " + " ".join(f"{cell(r):>{width}}" for _, width, cell in columns))


OP_NAMES = {"all_reduce": "gemm_all_reduce", "reduce_scatter": "gemm_reduce_scatter", "all_gather": "all_gather_gemm"}


def run_meta(world_size: int, command: str, environment: dict[str, str]) -> dict:
    """What a results file records about its run: the GPUs, the versions, the command, the date and the NCCL and
    CUDA variables it ran with (``environment``)."""
    return {"gpus": f"{world_size}x {torch.cuda.get_device_name()}", "world_size": world_size,
            "flashoverlap": fo.__version__, "torch": torch.__version__,
            "triton": importlib.metadata.version("triton"),
            "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()), "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "env": environment}


def write_results(path: str, meta: dict, rows: list[dict], extra: dict | None = None) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows, **(extra or {})}, f, indent=1)


def main(args, device: torch.device, command: str, environment: dict[str, str]) -> int:
    """``flashoverlap bench ops`` with its parsed options ``args`` on this rank's ``device``, the NCCL group started
    by the command line; ``command`` and ``environment`` go into the results' meta."""
    rank = dist.get_rank()
    dtype = getattr(torch, args.dtype)
    meta = run_meta(dist.get_world_size(), command, environment)
    if rank == 0:
        print(f"# {meta['gpus']}, torch {meta['torch']}, triton {meta['triton']}, NCCL {meta['nccl']}, "
              f"flashoverlap {meta['flashoverlap']}", flush=True)

    def timer(fns: dict, host: dict) -> dict:
        return time_side_by_side(fns, iters=args.iters, host_us=host)

    def log(rows: list[dict]) -> None:
        if rank == 0:
            row = rows[-1]
            print(f"  {row['op']} {row['M']}x{row['N']}x{row['K']}: done, E={row['E']:+.2f}", flush=True)

    rows = bench_rows(args.ops, args.shapes, dtype, timer, device=device, log=log)
    if rank == 0:
        for op in dict.fromkeys(r["op"] for r in rows):
            print_table(f"{OP_NAMES[op]}, path auto, {meta['gpus']}, {args.dtype} (ms)", [r for r in rows
                                                                                         if r["op"] == op])
        if args.out:
            write_results(args.out, meta, rows)
            print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # `python -m flashoverlap.bench ...`, as the results files record it: `bench ops ...`
    import sys

    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "flashoverlap", "bench", "ops", *sys.argv[1:]])
