"""What the shared-GPU steps share: the collective "go on?" check against the step's deadline, per-rank progress
files (what a rank finished survives a hang or a crash of the spawn), the environment the ranks get, and the
results files (rows merged into an existing file by key, so that a step split over several device calls builds one
file)."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

# What every spawned rank gets: no plan cache (the plans are the library's defaults, the same on every run).
RANK_ENV = {"FLASHOVERLAP_NO_CACHE": "1"}


def go_on(deadline: float, group=None) -> bool:
    """Collective (the world group, over gloo on CPU tensors): False on every rank once any rank is past
    ``deadline`` (``time.time()``), so that every rank stops before the same case."""
    late = torch.tensor([1 if time.time() > deadline else 0], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(late, op=dist.ReduceOp.MAX, group=group)
    return not bool(late.item())


class Progress:
    """A rank's progress file: one JSON object a line, flushed at once (``start`` before a case, ``row`` after)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = None if path is None else Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, **record) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()

    @staticmethod
    def read(path: str | os.PathLike) -> list[dict]:
        try:
            lines = Path(path).read_text().splitlines()
        except FileNotFoundError:
            return []
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash
                pass
        return records


def progress_path(directory: str | os.PathLike, step: str, world: int, rank: int) -> Path:
    return Path(directory) / ".progress" / f"{step}-W{world}-rank{rank}.jsonl"


def short(exc: BaseException, limit: int = 2000) -> str:
    """An exception as ``Type: message``, cut to ``limit`` characters."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 20] + " ...[cut]"


def tail(text: str, limit: int = 1500) -> str:
    return text if len(text) <= limit else "...[cut] " + text[-limit:]


def guarded(fn: Callable[[], object]) -> tuple[object, str | None]:
    """``(fn(), None)``, or ``(None, the error)`` where it raised (an AssertionError's message included)."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 -- a case's failure is recorded, the run goes on
        return None, short(exc) + ("" if isinstance(exc, AssertionError) else "\n" + tail(traceback.format_exc()))


def merge_rows(old: Iterable[dict], new: list[dict], key: Callable[[dict], object]) -> list[dict]:
    """``old`` without the rows whose ``key`` a row of ``new`` has, then ``new``."""
    replaced = {key(row) for row in new}
    return [row for row in old if key(row) not in replaced] + list(new)


def write_results(path: str | os.PathLike, meta: dict, rows: list[dict], key: Callable[[dict], object]) -> dict:
    """Write ``{"meta", "rows"}`` to ``path``, keeping an existing file's rows that ``rows`` do not replace (by
    ``key``). Every row names the commit that measured it; the file's ``meta`` is this run's, and its ``sources``
    list each run (commit, command, date) whose rows the file keeps."""
    path = Path(path)
    old_rows, sources = [], []
    if path.exists():
        try:
            old = json.loads(path.read_text())
            previous = old.get("meta", {})
            old_rows = [{"commit": previous.get("commit"), **row} for row in old.get("rows", [])]
            sources = previous.get("sources") or [_source(previous)]
        except (json.JSONDecodeError, AttributeError):
            old_rows = []
    rows = [{"commit": meta.get("commit"), **row} for row in rows]
    merged = merge_rows(old_rows, rows, key)
    commits = {row.get("commit") for row in merged}
    this = _source(meta)
    sources = [s for s in sources if isinstance(s, dict) and s.get("commit") in commits
               and (s.get("commit"), s.get("command")) != (this["commit"], this["command"])]  # a run's own, once
    meta = {**meta, "sources": sources + [this]}
    if "worlds" in meta:  # the W values of the rows the file holds, not only this run's
        meta["worlds"] = sorted({row["W"] for row in merged if isinstance(row.get("W"), int)} | set(meta["worlds"]))
    results = {"meta": meta, "rows": merged}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return results


def _source(meta: dict) -> dict:
    return {key: meta.get(key) for key in ("commit", "command", "date")}


def meta(step: str, worlds: list[int], command: str, **extra) -> dict:
    """A results file's ``meta`` (``benchmarks/diagnostics/results_file.results_meta``: GPUs, torch, the commit from
    ``FLASHOVERLAP_COMMIT``, the command, the date) for a step run at ``worlds`` ranks sharing one GPU."""
    from benchmarks.diagnostics.results_file import results_meta

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return results_meta(command, gpus=f"1x {name} shared by W processes (W: the rows' own)",
                        step=step, worlds=worlds, setting="shared-gpu, gloo group, CUDA IPC", **extra)


def device_of(kind: str) -> torch.device:
    """The device a rank runs on: ``cuda`` (the current one: every rank's is GPU 0) or ``cpu`` (the reference path,
    for a check of the harness itself)."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spawn_ranks(fn: Callable, world: int, args: tuple, timeout: float, device: str, env: dict | None = None):
    """``fn(rank, world, *args)`` on ``world`` ranks: on one GPU (``spawn_on_one_gpu``) or, for ``device="cpu"``,
    on gloo CPU ranks (``spawn``). Returns ``(results by rank or None, the spawn's error or None)``."""
    from flashoverlap.testing import spawn, spawn_on_one_gpu

    env = {**RANK_ENV, **(env or {})}
    try:
        if device == "cuda":
            return spawn_on_one_gpu(fn, world, args=args, env=env, timeout=timeout), None
        return spawn(fn, world, "gloo", args=args, env=env, timeout=timeout), None
    except Exception as exc:  # noqa: BLE001 -- a hang or a crash: the progress files hold what was done
        return None, short(exc, 4000)
