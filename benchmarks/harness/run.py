"""A harness benchmark's start under torchrun and its results file, written once."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from benchmarks.harness.gpu_tag import gpu_tag
from flashoverlap.bench import out_problem, ranks_beyond_gpus, run_meta, write_results
from flashoverlap.cli import VALUE_OPTIONS, environment, join_values

# The harness's options whose value may start with "-" (``cli.join_values``), besides the installed commands'.
HARNESS_VALUE_OPTIONS = VALUE_OPTIONS + ("--tokens", "--steps", "--decode-tokens", "--sweep-iters",
                                         "--sweep-groups", "--sweep-ctas", "--warmup")


def setting() -> str:
    """The run's NCCL transport: "pcie-like" with NCCL_P2P_DISABLE=1 (traffic through host memory), else "nvlink"."""
    return "pcie-like" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink"


def commit() -> str:
    """``FLASHOVERLAP_COMMIT`` where set (the device machines' git snapshot is stale), else this checkout's HEAD
    (``-dirty`` with uncommitted changes to tracked files), else "unknown"."""
    if "FLASHOVERLAP_COMMIT" in os.environ:
        return os.environ["FLASHOVERLAP_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return head.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def results_meta(world_size: int, command: str) -> dict:
    """``flashoverlap.bench.run_meta`` with the setting and the commit; ``command`` unless ``FLASHOVERLAP_COMMAND``
    names the exact command (a script's, with its environment)."""
    return {**run_meta(world_size, os.environ.get("FLASHOVERLAP_COMMAND", command), environment()),
            "setting": setting(), "commit": commit()}


def start_run(prog: str, description: str, add_arguments, argv: list[str] | None,
              suffix: str) -> tuple[argparse.Namespace, list[str], dict, str, torch.device]:
    """A benchmark's start under torchrun: its options parsed (``add_arguments``), the NCCL group on this rank's GPU,
    the results' meta and the default results path ``benchmarks/results/<gpu>x<W>-<setting><suffix>.json``.
    Returns the options, the argument list as parsed, the meta, the path and the device."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    argv = join_values(list(sys.argv[1:] if argv is None else argv), HARNESS_VALUE_OPTIONS)
    args = parser.parse_args(argv)
    problem = out_problem(getattr(args, "out", None))  # rank 0 writes it after the first row, or at the end; named
    if problem:  # as such on any machine (on one without GPUs it was "needs CUDA GPUs")
        parser.error(problem)
    if not torch.cuda.is_available():  # before any CUDA call: one line, not a traceback from set_device
        raise SystemExit(f"{prog}: needs CUDA GPUs (under torchrun --nproc-per-node N); on a CPU-only machine run "
                         "`flashoverlap demo` or the tests")
    if "RANK" not in os.environ:
        parser.error(f"run it under torchrun, e.g. torchrun --nproc-per-node 2 -m {prog.split()[-1]}")
    beyond = ranks_beyond_gpus()  # a rank past the last GPU would fail in set_device, the others wait
    if beyond is not None:
        local_ranks, gpus = beyond
        raise SystemExit(f"{prog}: {local_ranks} ranks on this node but {gpus} CUDA GPU{'s' if gpus > 1 else ''}: "
                         f"one per rank; use torchrun --nproc-per-node {gpus} or fewer")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    world_size = dist.get_world_size()
    meta = results_meta(world_size, " ".join([prog, *argv]))
    gpu = gpu_tag()
    out = args.out or os.path.join("benchmarks", "results", f"{gpu}x{world_size}-{meta['setting']}{suffix}.json")
    return args, argv, meta, out, device


def finish_run(path: str, meta: dict, rows: list[dict]) -> int:
    """A torchrun benchmark's end: rank 0 writes the results, then the group is taken down."""
    if dist.get_rank() == 0:
        write_results(path, meta, rows)
        print(f"wrote {path}")
    dist.destroy_process_group()
    return 0
