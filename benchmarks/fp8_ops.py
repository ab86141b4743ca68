"""``torchrun --nproc-per-node 2 -m benchmarks.fp8_ops`` (from the root of a source checkout, ``PYTHONPATH=src:.``):
the fp8 ops at the bf16 grid's shapes (docs/benchmarks.md, "fp8"), in each scaling mode
(tensor-wise, row-wise, block-wise 1x128 / 128x128), beside the plain PyTorch code they replace.

Per op, shape and scaling, timed side by side (``flashoverlap.tune.timing.time_side_by_side``: CUDA events, each call
queued behind a GPU sleep, the calls interleaved, median per rank over ``--iters`` >= 20 calls, maximum over ranks):

- ``T_gemm``: the per-rank ``torch._scaled_mm`` alone (all-gather: on the gathered A);
- ``T_comm``: the NCCL collective alone: all-reduce / reduce-scatter of the bf16 ``[M, N]`` product; all-gather of
  the fp8 shard (as bytes) and, row- and block-wise, of its scales;
- ``T_seq``: ``torch._scaled_mm`` then the collective, one after the other (all-gather: the gathers, the gathered
  block-wise scales laid out as torch's block-wise kernel takes them, then ``_scaled_mm``); ``T_ideal = max(T_gemm,
  T_comm)``;
- ours: ``flashoverlap.scaled_gemm_all_reduce`` / ``scaled_gemm_reduce_scatter`` / ``all_gather_scaled_gemm`` with
  each explicit path that runs fp8 here (``path="nccl"``; ``"p2p"`` where ``runtime.policy.FP8_PATHS`` has it, on
  NVLink) and with ``path="auto"`` (what a plain call gets, the row's ``auto``);
- PyTorch's fused scaled ops, ``torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter`` and
  ``fused_all_gather_scaled_matmul`` (symmetric memory enabled for the group; NVLink only), where they take the mode
  (``t_fused_scaled_ms``, also ``baselines.async_tp_ms``; None with ``baselines.async_tp_note`` saying why: no fused
  all-reduce, an error, or a wrong result);
- the bf16 op of the same shape (``flashoverlap.gemm_all_reduce`` etc., ``path="auto"``) on the fp8 operands cast to
  bf16 (``t_bf16_op_ms``).

Shapes follow ``flashoverlap.bench.calls``: all-reduce and reduce-scatter ``(M, N, K)`` is each rank's product,
``a [M, K]``; all-gather's M is the gathered size (shard ``[M/W, K]``). ``b = w.t()`` of an ``[N, K]`` fp8 weight.
Operands: fresh ``randn * 3`` cast to ``float8_e4m3fn`` (never zeros), scales ``rand + 0.5`` fp32: tensor-wise one
value each (all-gather: one A scale shared by the ranks, as torch's fused op assumes), row-wise A ``[M, 1]``, B ``[1,
N]``, block-wise A ``[M, K/128]`` (outer-dim-major; an all-gather shard's row-major, to be gathered), B ``[K/128,
ceil(N/128)]`` (the transpose of a contiguous ``[ceil(N/128), K/128]`` weight scale). Before timing, every op's
result is checked against T_seq's (relative error ``max|got - want| / max|want|`` < 1e-2, maximum over ranks): ours
and the bf16 op raise on a mismatch; torch's fused op is recorded as None with the error in the note.

Rows: the bf16 file's fields (op, path, dtype, M, N, K, t_gemm_ms, t_comm_ms, t_seq_ms, t_ms, t_ideal_ms, speedup,
E, host_us, baselines) plus ``scaling``, ``t_bf16_op_ms``, ``t_fused_scaled_ms``, ``rel_err`` and ``auto``; one row
per explicit path. Writes ``benchmarks/results/<gpu>x<W>-<setting>-fp8.json`` (``--out``), rank 0, after each row.

``--dry-run``: gloo, tiny shapes (``DRY_SHAPES``), the reference path, wall-clock times:
the script's logic (inputs, scales, checks, rows, the results file) on the CPU, e.g.
``PYTHONPATH=src:. torchrun --nproc-per-node 2 -m benchmarks.fp8_ops --dry-run``; its default ``--out`` is in the
temporary directory. ``tests/benchmarks/test_fp8_ops.py`` runs it at W = 2.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.results_file import require_cuda
from benchmarks.harness.gpu_tag import gpu_tag
from benchmarks.harness.run import commit, results_meta, setting
from flashoverlap import settings
from flashoverlap.bench import (
    COLUMNS,
    GRIDS,
    OP_FUNCTIONS,
    efficiency,
    ms,
    op_row,
    out_problem,
    print_table,
    write_results,
)
from flashoverlap.cli import op_names, positive, shapes
from flashoverlap.comm.scaled import BLOCK, Scales, cublas_takes
from flashoverlap.runtime.calls import GemmSpec, resolve
from flashoverlap.runtime.policy import FP8_PATHS
from flashoverlap.tune.timing import time_side_by_side

FP8 = torch.float8_e4m3fn
OUT_DTYPE = torch.bfloat16
SCALINGS = Scales.MODES  # ("tensor", "row", "block")
OPS = ("all_reduce", "reduce_scatter", "all_gather")
SCALED_OPS = fo.ops.SCALED_OPS
DRY_SHAPES = [(64, 48, 256)]  # block-wise: K/128 = 2 blocks, one partial N block; all-gather shards of 32 rows
TOLERANCE = 1e-2
MIN_ITERS = 20
# torch >= 2.13 deprecates the *_tensor names for *_single, which older torch does not have.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# -- operands ------------------------------------------------------------------------------------------------------


def fp8_operands(op: str, shape: tuple[int, int, int], scaling: str, rank: int, world: int,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's fresh fp8 ``a`` (all-gather: its shard of M/W rows) and ``b = w.t()``, and their fp32 scales in
    ``scaling``'s shapes (module docstring)."""
    m, n, k = shape
    rows = m // world if op == "all_gather" else m
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    a = (torch.randn(rows, k, device=device, generator=gen) * 3).to(FP8)
    w = (torch.randn(n, k, device=device, generator=gen) * 3).to(FP8)  # an [N, K] weight; b its transposed view

    def rand(*size, generator=gen):
        return torch.rand(size, device=device, generator=generator) + 0.5

    if scaling == "tensor":
        shared = torch.Generator(device=device).manual_seed(99)  # all-gather: one A scale on every rank
        scale_a, scale_b = (rand(generator=shared) if op == "all_gather" else rand()), rand()
    elif scaling == "row":
        scale_a, scale_b = rand(rows, 1), rand(1, n)
    else:
        kb, nb = k // BLOCK, math.ceil(n / BLOCK)
        scale_a = rand(rows, kb)
        if op != "all_gather":  # outer-dim-major, as torch's block-wise kernel takes it (a shard is gathered first)
            scale_a = scale_a.t().contiguous().t()
        scale_b = rand(nb, kb).t()
    return {"a": a, "b": w.t(), "scale_a": scale_a, "scale_b": scale_b}


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  scaling: str) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b)`` in bf16 (tensor- and row-wise run on the CPU too; block-wise
    where cuBLAS takes the shape); elsewhere the dequantised fp32 product rounded to bf16, written out here (not the
    library's: an oracle that shares the code it checks cannot see that code's mistakes)."""
    if scaling != "block" or cublas_takes(a, b, scaling):
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=OUT_DTYPE)
    k, n = b.shape
    a32 = a.float() * scale_a.float().repeat_interleave(BLOCK, 1)[:, :k]
    b32 = b.float() * scale_b.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:k, :n]
    return (a32 @ b32).to(OUT_DTYPE)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|``, the maximum over ranks."""
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    err = err.reshape(1).to(torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return float(err)


def everyone(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# -- the calls of one row -----------------------------------------------------------------------------------------


def plain_calls(op: str, shape: tuple[int, int, int], scaling: str, x: dict[str, torch.Tensor],
                world: int) -> dict[str, Callable[[], torch.Tensor | None]]:
    """``gemm``, ``comm`` and ``seq`` (which returns this rank's result) of the plain PyTorch code."""
    m, n, k = shape
    a, b, sa, sb = x["a"], x["b"], x["scale_a"], x["scale_b"]
    device = a.device
    if op == "all_reduce":
        c = scaled_matmul(a, b, sa, sb, scaling)

        def seq():
            out = scaled_matmul(a, b, sa, sb, scaling)
            dist.all_reduce(out)
            return out

        return {"gemm": lambda: scaled_matmul(a, b, sa, sb, scaling), "comm": lambda: dist.all_reduce(c), "seq": seq}
    if op == "reduce_scatter":
        c = scaled_matmul(a, b, sa, sb, scaling)
        out = torch.empty((m // world, n), dtype=OUT_DTYPE, device=device)

        def seq():
            result = torch.empty((m // world, n), dtype=OUT_DTYPE, device=device)
            _reduce_scatter(result, scaled_matmul(a, b, sa, sb, scaling))
            return result

        return {"gemm": lambda: scaled_matmul(a, b, sa, sb, scaling), "comm": lambda: _reduce_scatter(out, c),
                "seq": seq}
    # all-gather: the fp8 rows as bytes (every backend moves uint8), the scales beside them (row- and block-wise)
    a_full = torch.empty((m, k), dtype=FP8, device=device)
    gathered_scales = None if scaling == "tensor" else torch.empty((m, sa.shape[1]), dtype=torch.float32,
                                                                   device=device)

    def comm():
        _all_gather(a_full.view(torch.uint8), a.view(torch.uint8))
        if gathered_scales is not None:
            _all_gather(gathered_scales, sa)

    def full_scale_a():
        if gathered_scales is None:
            return sa
        return gathered_scales.t().contiguous().t() if scaling == "block" else gathered_scales

    comm()
    laid_out = full_scale_a().clone() if scaling == "block" else full_scale_a()

    def seq():
        comm()
        return scaled_matmul(a_full, b, full_scale_a(), sb, scaling)

    return {"gemm": lambda: scaled_matmul(a_full, b, laid_out, sb, scaling), "comm": comm, "seq": seq}


def fused_call(op: str, shape: tuple[int, int, int], x: dict[str, torch.Tensor],
               dry_run: bool, setting_name: str) -> tuple[Callable[[], torch.Tensor] | None, str | None]:
    """torch's fused scaled op for ``op`` as a callable, or None and why it does not apply here."""
    if op == "all_reduce":
        return None, "torch async TP has no fused scaled all-reduce"
    if dry_run:
        return None, "dry run: torch's fused scaled ops need CUDA symmetric memory"
    if setting_name != "nvlink":
        return None, "nvlink setting only"
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        name = dist.group.WORLD.group_name
        enable_symm_mem_for_group(name)
        ops = torch.ops.symm_mem
    except Exception as exc:  # an older torch, or symmetric memory unavailable here
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    m, n, _ = shape
    a, b, sa, sb = x["a"], x["b"], x["scale_a"], x["scale_b"]
    if op == "reduce_scatter":
        return (lambda: ops.fused_scaled_matmul_reduce_scatter(a, b, sa, sb, "sum", 0, 0, name, [m, n],
                                                               out_dtype=OUT_DTYPE)), None
    return (lambda: ops.fused_all_gather_scaled_matmul(a, [b], sa, [sb], 0, name, [None], [None], [OUT_DTYPE],
                                                       [False])[1][0]), None


def checked_fused(fn, want: torch.Tensor, device: torch.device) -> tuple[Callable | None, str | None, float | None]:
    """``fn`` if one call runs on every rank and matches ``want``, else None and why."""
    try:
        got, why = fn(), None
    except Exception as exc:  # a mode torch refuses, symmetric memory unavailable, ...
        got, why = None, f"{type(exc).__name__}: {str(exc)[:300]}"
    if not everyone(got is not None, device):
        return None, why or "failed on another rank", None
    err = rel_err(got, want)
    if not err < TOLERANCE:
        return None, f"wrong result: relative error {err:.2e} against T_seq's", err
    return fn, None, err


def explicit_paths(dry_run: bool, setting_name: str) -> list[str]:
    """The explicit paths that run fp8 here: the reference path in a dry run; NCCL, and P2P on NVLink where
    ``FP8_PATHS`` has it."""
    if dry_run:
        return ["reference"]
    return [p for p in FP8_PATHS if p != "p2p" or setting_name == "nvlink"]


def auto_path(op: str, x: dict[str, torch.Tensor]) -> str:
    """The path an untuned ``path="auto"`` call takes here ("sequential" where its plan is scaled matmul then the
    collective)."""
    name = SCALED_OPS[op].__name__
    spec = GemmSpec(name, op, x["a"], x["b"], scales=Scales.of(x["scale_a"], x["scale_b"]))
    path, _, plan = resolve(spec, settings.current().nccl_p2p_disabled)
    return "sequential" if plan.sequential and path != "reference" else path


# -- timing ---------------------------------------------------------------------------------------------------------


def wall_side_by_side(fns: dict[str, Callable[[], object]], *, warmup: int = 1, iters: int = 3,
                      host_us: dict[str, float] | None = None) -> dict[str, float]:
    """The dry run's stand-in for ``time_side_by_side``: wall-clock medians (ms) of each function, the ranks aligned
    before each call, the maximum over ranks. Not a GPU figure."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(iters):
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(1e3 * (time.perf_counter() - t0))
    medians = torch.tensor([statistics.median(times[name]) for name in names], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    result = dict(zip(names, medians.tolist()))
    if host_us is not None:
        host_us.update({name: 1e3 * value for name, value in result.items()})
    return result


# -- rows -----------------------------------------------------------------------------------------------------------


def bench_case(op: str, shape: tuple[int, int, int], scaling: str, *, iters: int, dry_run: bool,
               setting_name: str, device: torch.device) -> list[dict]:
    """The rows of ``op`` at ``shape`` in ``scaling``: one per explicit path, every figure timed side by side."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = fp8_operands(op, shape, scaling, rank, world, device)
    a, b, sa, sb = x["a"], x["b"], x["scale_a"], x["scale_b"]
    fns: dict[str, Callable] = dict(plain_calls(op, shape, scaling, x, world))
    want = fns["seq"]()
    ours = SCALED_OPS[op]
    paths = explicit_paths(dry_run, setting_name)
    errors = {}
    for path in [*paths, "auto"]:
        fns[f"ours_{path}"] = lambda path=path: ours(a, b, sa, sb, path=path)
        errors[path] = rel_err(fns[f"ours_{path}"](), want)
        if not errors[path] < TOLERANCE:
            raise AssertionError(f"{ours.__name__} {scaling} {shape} path={path}: relative error {errors[path]:.2e} "
                                 f"against _scaled_mm then the collective (limit {TOLERANCE})")
    auto = auto_path(op, x)
    gemm_a = a if op != "all_gather" else torch.empty((shape[0], shape[2]), dtype=FP8, device=device)
    kernel = ("torch._scaled_mm" if scaling != "block" or cublas_takes(gemm_a, b, scaling)
              else "dequantised fp32 product (torch._scaled_mm does not take this block-wise shape here)")
    # The bf16 op at the same shape on the same values (unscaled), checked against matmul then the collective.
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    bf16_op = OP_FUNCTIONS[op]
    fns["bf16_op"] = lambda: bf16_op(a16, b16)
    bf16_err = rel_err(fns["bf16_op"](), plain_bf16(op, a16, b16, world))
    if not bf16_err < TOLERANCE:
        raise AssertionError(f"{bf16_op.__name__} {shape}: relative error {bf16_err:.2e} against matmul then the "
                             f"collective (limit {TOLERANCE})")
    fused, why = fused_call(op, shape, x, dry_run, setting_name)
    fused_err = None
    if fused is not None:
        fused, why, fused_err = checked_fused(fused, want, device)
    if fused is not None:
        fns["fused"] = fused
    host: dict[str, float] = {}
    if dry_run:
        t = wall_side_by_side(fns, host_us=host)
    else:
        t = time_side_by_side(fns, warmup=5, iters=iters, host_us=host)
    rows = []
    for path in paths:
        row = {"path": path, **op_row(op, shape, FP8, {**t, "ours": t[f"ours_{path}"]},
                                      {**host, "ours": host[f"ours_{path}"]})}
        t_fused = t.get("fused")
        row.update({
            "scaling": scaling, "out_dtype": str(OUT_DTYPE).replace("torch.", ""), "t_gemm_kernel": kernel,
            "t_bf16_op_ms": t["bf16_op"], "t_fused_scaled_ms": t_fused,
            "rel_err": {"ours": errors[path], "auto": errors["auto"], "bf16_op": bf16_err, "fused": fused_err},
            "baselines": {"decomposition_ms": None, "async_tp_ms": t_fused,
                          **({"async_tp_note": why} if t_fused is None else {})},
            "auto": {"t_ms": t["ours_auto"], "E": efficiency(t["seq"], t["ours_auto"], row["t_ideal_ms"]),
                     "speedup": t["seq"] / t["ours_auto"], "path": auto, "host_us": host.get("ours_auto")},
        })
        if dry_run:
            row["timing"] = "wall clock (dry run)"
        rows.append(row)
    return rows


def plain_bf16(op: str, a: torch.Tensor, b: torch.Tensor, world: int) -> torch.Tensor:
    """The plain bf16 code: matmul then the collective (all-gather: gather, then matmul)."""
    if op == "all_gather":
        full = torch.empty((a.shape[0] * world, a.shape[1]), dtype=a.dtype, device=a.device)
        _all_gather(full, a.contiguous())
        return full @ b
    c = a @ b
    if op == "all_reduce":
        dist.all_reduce(c)
        return c
    out = torch.empty((c.shape[0] // world, c.shape[1]), dtype=c.dtype, device=c.device)
    _reduce_scatter(out, c)
    return out


def bench_rows(ops: list[str], scalings: list[str], shape_list: list[tuple[int, int, int]] | None, *, iters: int,
               dry_run: bool, setting_name: str, device: torch.device,
               log: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every row of ``ops`` x shapes (``shape_list``, else each op's grid; dry run: ``DRY_SHAPES``) x ``scalings``;
    ``log(rows)`` after each case."""
    rows: list[dict] = []
    threads = torch.get_num_threads()
    if dry_run:  # the ranks share the CPU: more threads than cores made each tiny call 10-20x slower
        torch.set_num_threads(1)
    try:
        for op in ops:
            for shape in shape_list or (DRY_SHAPES if dry_run else GRIDS[op]):
                for scaling in scalings:
                    rows.extend(bench_case(op, shape, scaling, iters=iters, dry_run=dry_run,
                                           setting_name=setting_name, device=device))
                    if log is not None:
                        log(rows)
    finally:
        torch.set_num_threads(threads)
    return rows


# -- the run --------------------------------------------------------------------------------------------------------


def run_meta(world: int, command: str, dry_run: bool) -> dict:
    """The results' meta: the harness's (GPUs, versions, setting, commit: ``FLASHOVERLAP_COMMIT`` where set, command,
    date); in a dry run the same fields with the CPU's."""
    if not dry_run:
        return {**results_meta(world, command), "dry_run": False}
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {"gpus": "cpu (dry run)", "world_size": world, "flashoverlap": fo.__version__, "torch": torch.__version__,
            "triton": triton, "nccl": None, "setting": "dry-run", "commit": commit(),
            "command": os.environ.get("FLASHOVERLAP_COMMAND", command),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "dry_run": True}


def default_out(world: int, setting_name: str, dry_run: bool) -> str:
    if dry_run:
        return os.path.join(tempfile.gettempdir(), f"fp8_ops-dry-run-x{world}.json")
    gpu = gpu_tag()
    return os.path.join("benchmarks", "results", f"{gpu}x{world}-{setting_name}-fp8.json")


def scaling_names(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SCALINGS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"scalings are {', '.join(SCALINGS)}; got {text!r}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node 2 -m benchmarks.fp8_ops",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=op_names, default=list(OPS), metavar="OPS",
                   help="comma-separated: all_reduce, reduce_scatter, all_gather (default: all three)")
    p.add_argument("--scalings", type=scaling_names, default=list(SCALINGS), metavar="S,S",
                   help="comma-separated: tensor, row, block (default: all three)")
    p.add_argument("--shapes", type=shapes, default=None, metavar="M,N,K;...",
                   help="shapes for every op (default: each op's bf16 grid; dry run: 64,48,256)")
    p.add_argument("--iters", type=positive, default=MIN_ITERS, help=f"timed calls per figure (>= {MIN_ITERS})")
    p.add_argument("--dry-run", action="store_true",
                   help="gloo, tiny shapes, the reference path, wall-clock times (the CPU check of the script)")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<gpu>x<W>-<setting>-fp8.json)")
    return p


def case_problem(args: argparse.Namespace, world: int) -> str | None:
    """Why a case of the run could not be timed, in one line (None where each can): reduce-scatter and all-gather
    split M over the ``world`` ranks, and block-wise scales cover K in whole blocks of ``BLOCK``. Found before the
    group starts: a case that fails in the middle ended in a traceback from every rank, the rows before it unwritten
    where ``--out`` was not yet due."""
    for op in args.ops:
        for m, n, k in args.shapes or (DRY_SHAPES if args.dry_run else GRIDS[op]):
            which = "--shapes" if args.shapes else "the default shape"
            if op != "all_reduce" and m % world:
                return f"{which} {m},{n},{k}: {op} needs M divisible by the {world} ranks"
            if "block" in args.scalings and k % BLOCK:
                return (f"{which} {m},{n},{k}: block-wise scales need K divisible by {BLOCK}; pass --scalings "
                        "tensor,row or such K")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if "RANK" not in os.environ:
        parser().error("run it under torchrun, e.g. torchrun --nproc-per-node 2 -m benchmarks.fp8_ops")
    world = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else 1
    problem = out_problem(args.out) or case_problem(args, world)  # rank 0 writes --out after the first row
    if problem:
        parser().error(problem)
    dry_run = args.dry_run
    if not dry_run:  # without CUDA it used to fall into a dry run and write its file under the GPU results' name
        require_cuda("benchmarks.fp8_ops (--dry-run runs it on the CPU)", per_rank=True)
    if not dry_run and args.iters < MIN_ITERS:
        parser().error(f"--iters must be at least {MIN_ITERS} (docs/benchmarks.md's timing)")
    if dry_run:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    run(args, argv, dry_run, device)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run(args: argparse.Namespace, argv: list[str], dry_run: bool, device: torch.device) -> tuple[dict, list[dict], str]:
    """The benchmark in a started process group: every row, the tables and the results file (rank 0). Returns the
    meta, the rows and the results path."""
    world, rank = dist.get_world_size(), dist.get_rank()
    meta = run_meta(world, f"torchrun --nproc-per-node {world} -m benchmarks.fp8_ops " + shlex.join(argv),
                    dry_run)
    setting_name = "dry-run" if dry_run else setting()
    out = args.out or default_out(world, setting_name, dry_run)
    if rank == 0:
        print(f"# {meta['gpus']}, {meta['setting']}, torch {meta['torch']}, triton {meta['triton']}, "
              f"NCCL {meta['nccl']}, commit {meta['commit']}", flush=True)

    def log(rows: list[dict]) -> None:
        if rank == 0:
            for r in rows[-len(explicit_paths(dry_run, setting_name)):]:
                print(f"  {r['op']} {r['scaling']} {r['M']}x{r['N']}x{r['K']} path {r['path']}: E={r['E']:+.2f}, "
                      f"auto ({r['auto']['path']}) E={r['auto']['E']:+.2f}", flush=True)
            write_results(out, meta, rows)  # so far, in case a later row fails

    rows = bench_rows(args.ops, args.scalings, args.shapes, iters=args.iters, dry_run=dry_run,
                      setting_name=setting_name, device=device, log=log)
    if rank == 0:
        print_tables(rows, meta)
        write_results(out, meta, rows)
        print(f"wrote {out}")
    return meta, rows, out


FP8_COLUMNS = [*COLUMNS[:3], ("fusedTP", 7, lambda r: ms(r["t_fused_scaled_ms"])),
               ("bf16 op", 7, lambda r: ms(r["t_bf16_op_ms"])), *COLUMNS[3:7],
               ("auto: T", 7, lambda r: ms(r["auto"]["t_ms"])), ("E", 6, lambda r: f"{r['auto']['E']:+6.2f}"),
               ("path", 10, lambda r: r["auto"]["path"])]


def print_tables(rows: list[dict], meta: dict) -> None:
    """One table per op, scaling and path."""
    for key in dict.fromkeys((r["op"], r["scaling"], r["path"]) for r in rows):
        op, scaling, path = key
        print_table(f"{SCALED_OPS[op].__name__}, {scaling}-wise fp8, path {path}, {meta['gpus']}, {meta['setting']}"
                    " (ms)", [r for r in rows if (r["op"], r["scaling"], r["path"]) == key], FP8_COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
