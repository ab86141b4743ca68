"""The on-disk plan cache: tuned plans, one JSON file per (GPU name, world size, op, path, dtype, and whether NCCL's
peer-to-peer transport is disabled), entries by shape.

Where: ``$FLASHOVERLAP_CACHE_DIR``, else ``~/.cache/flashoverlap/``; ``FLASHOVERLAP_NO_CACHE=1`` turns lookups and
writes off. A file that cannot be read, is not JSON, or describes another key is reported once (a warning) and
ignored, and so is an entry that cannot be this key's (its plan for another op, world size or shape); a call never
fails because of the cache. Writers merge their entries into the file under a lock and replace it atomically, so
concurrent tuners lose nothing and readers never see half a file; a file that is not this version's for its key is
never replaced (another install's, or one to look at): ``store`` refuses, and ``write_problem`` says so before a
tuner measures anything.

Ranks must use the same plan (different plans issue different collectives and hang), and on several nodes their
caches may differ: ``exchange_entries`` gives every rank rank 0's entries, exchanged once per group.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import tempfile
import warnings
from pathlib import Path

import torch.distributed as dist

from flashoverlap import guards, settings
from flashoverlap.plan import OPS, PLAN_PATHS, Plan
from flashoverlap.tune.defaults import default_plan

VERSION = 1
NO_CACHE = "tune needs the cache: unset FLASHOVERLAP_NO_CACHE"
# A shape never tuned borrows the plan of the tuned M nearest to it (same N and K), within this factor.
NEAREST_M_FACTOR = 2.0
_WARNED: set[str] = set()
_generation = 0  # bumped by forget_agreed: older exchanges are stale


def cache_dir() -> Path | None:
    """The cache directory, or None when ``FLASHOVERLAP_NO_CACHE=1`` (``flashoverlap.settings``)."""
    return settings.current().cache_dir


def cache_key(gpu: str, world_size: int, op: str, path: str, dtype: str,
              nccl_p2p_disabled: bool | None = None) -> dict:
    """What a tuned plan depends on. With NCCL's peer-to-peer transport disabled (``NCCL_P2P_DISABLE=1``) NCCL
    moves data through host memory, a different machine as far as plans go (the benchmark's pcie-like setting):
    that is part of the key too. ``nccl_p2p_disabled`` is the caller's value (the runtime's is
    ``runtime.settings.current().nccl_p2p_disabled``, read once); None, for callers that have none, reads the
    environment here."""
    if nccl_p2p_disabled is None:
        nccl_p2p_disabled = _p2p_disabled_in_environment()
    key = {"gpu": gpu, "world_size": world_size, "op": op, "path": path, "dtype": dtype}
    if nccl_p2p_disabled:
        key["nccl_p2p"] = "disabled"
    return key


def _p2p_disabled_in_environment() -> bool:
    # The default for callers that pass no value: the settings' (read once).
    return settings.current().nccl_p2p_disabled


def cache_file(key: dict) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", key["gpu"]).strip("-").lower()
    suffix = "-nccl-p2p-disabled" if key.get("nccl_p2p") == "disabled" else ""
    return root / f"{gpu}-w{key['world_size']}-{key['op']}-{key['path']}-{key['dtype']}{suffix}.json"


def _warn_once(what: str, why: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"flashoverlap: ignoring plan cache {what}: {why}", RuntimeWarning, stacklevel=3)


def _read(path: Path, key: dict) -> tuple[dict[str, dict], str | None]:
    """``path``'s entries if it is this version's file of ``key`` (``(entries, None)``), else ``({}, why not)``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, f"unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
        return {}, f"not a version-{VERSION} flashoverlap plan cache"
    if data.get("key") != key:
        return {}, f"it describes {data.get('key')!r}, not {key!r}"
    return data["entries"], None


def load(key: dict) -> dict[str, dict]:
    """The cached entries for ``key``, by ``"MxNxK"`` (empty when there are none or the file is unusable)."""
    path = cache_file(key)
    if path is None or not path.exists():
        return {}
    entries, why = _read(path, key)
    if why is not None:
        _warn_once(f"file {path}", why)
    return entries


def _not_replaced(path: Path, why: str) -> str:
    return (f"not replacing plan cache file {path}: {why}; move it away (or set FLASHOVERLAP_CACHE_DIR to another "
            "directory) and tune again")


def write_problem(key: dict | None = None) -> str | None:
    """Why a tuner could not store what it measures (None if it can), in one line: the cache is off, its directory
    cannot be written here, or ``key``'s file is one ``store`` would not replace. Creates the directory."""
    root = cache_dir()
    if root is None:
        return NO_CACHE
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        return (f"the plan cache directory {root} cannot be written ({type(exc).__name__}: {exc}); set "
                "FLASHOVERLAP_CACHE_DIR to a writable directory")
    path = cache_file(key) if key is not None else None
    why = _read(path, key)[1] if path is not None and path.exists() else None
    return None if why is None else _not_replaced(path, why)


def store(key: dict, plan: Plan, measured_ms: float | None = None, how: str = "") -> Path | None:
    """Add (or replace) ``plan``'s entry in ``key``'s file; returns the file (None when the cache is off). Raises
    ``RuntimeError`` where the file exists and is not this version's for ``key`` (it is left as it is)."""
    path = cache_file(key)
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"plan": plan.to_dict(), "measured_ms": measured_ms, "how": how}
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer merges at a time
        entries, why = _read(path, key) if path.exists() else ({}, None)
        if why is not None:
            raise RuntimeError(f"flashoverlap: {_not_replaced(path, why)}")
        entries[f"{plan.m}x{plan.n}x{plan.k}"] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "key": key, "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    return path


def select(entries: dict[str, dict], op: str, m: int, n: int, k: int, world_size: int,
           num_sms: int) -> Plan | None:
    """The cached plan for this shape: its own entry, else one derived from the tuned M nearest to ``m`` (same N
    and K, within ``NEAREST_M_FACTOR``): the same tile, programs, NCCL CTAs, path and number of groups. None if
    neither exists or an entry is invalid."""
    exact = _entry(entries, f"{m}x{n}x{k}", op, world_size)
    if exact is not None:
        return exact
    tuned, distance = None, math.log(NEAREST_M_FACTOR) + 1e-9
    for shape in entries:
        try:
            em, en, ek = (int(x) for x in shape.split("x"))
        except ValueError:
            continue
        if (en, ek) != (n, k) or em <= 0 or abs(math.log(em / m)) > distance:
            continue
        plan = _entry(entries, shape, op, world_size)
        if plan is not None:
            tuned, distance = plan, abs(math.log(em / m))
    if tuned is None:
        return None
    try:
        overlapped = default_plan(op, m, n, k, world_size, num_sms=num_sms, tile=tuned.tile,
                                  num_groups=tuned.sub_bands, comm_ctas=tuned.comm_ctas, path=tuned.path,
                                  num_programs=None if tuned.num_programs >= tuned.num_tiles else tuned.num_programs,
                                  gemm=tuned.gemm, allow_sequential=False)  # one program per tile stays so
        if not tuned.sequential:
            return overlapped
        return Plan(op, m, n, k, world_size, tuned.tile, (overlapped.tiles_per_block,), num_sms, 0, True, tuned.path)
    except ValueError:
        return None


def _entry(entries: dict[str, dict], shape: str, op: str, world_size: int) -> Plan | None:
    """The plan of ``entries[shape]`` if it is one of ``op`` over ``world_size`` ranks at that shape; None if
    there is none or it is invalid, or another's (hand-edited, or merged from elsewhere: warned once)."""
    entry = entries.get(shape)
    if entry is None:
        return None
    try:
        plan = Plan.from_dict(entry["plan"])
    except (KeyError, TypeError, ValueError):
        return None
    if (plan.op, plan.world_size, f"{plan.m}x{plan.n}x{plan.k}") != (op, world_size, shape):
        _warn_once(f"entry {shape!r} of {op} over {world_size} ranks",
                   f"its plan is {plan.op}'s of {plan.m}x{plan.n}x{plan.k} over {plan.world_size} ranks")
        return None
    return plan


def exchange_entries(group: dist.ProcessGroup, gpu: str, world_size: int,
                     nccl_p2p_disabled: bool | None = None) -> dict[str, dict[str, dict]]:
    """Rank 0's cached entries for every op, path and dtype of this GPU and world size (and NCCL transport:
    ``nccl_p2p_disabled`` as in ``cache_key``), the same on every rank of ``group`` (collective: one broadcast), by
    ``"op/path/dtype"``. The runtime exchanges once per group and ``generation()`` and keeps the answer, so that
    later first calls of other ops or dtypes, inside a CUDA-graph capture too, need no collective."""
    guards.refuse_inside_capture("the first call for a process group exchanges the plan cache between ranks")
    if nccl_p2p_disabled is None:
        nccl_p2p_disabled = _p2p_disabled_in_environment()
    every = {}
    if dist.get_rank(group) == 0:
        for op in OPS:
            for path in (*PLAN_PATHS, "auto"):  # "auto": `tune plan --path auto`, whose plans name their path
                for dtype in ("bfloat16", "float16"):
                    entries = load(cache_key(gpu, world_size, op, path, dtype, nccl_p2p_disabled))
                    if entries:
                        every[f"{op}/{path}/{dtype}"] = entries
    box = [every]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def entries_for(every: dict[str, dict[str, dict]], key: dict) -> dict[str, dict]:
    """``key``'s entries out of ``exchange_entries``' answer."""
    return every.get(f"{key['op']}/{key['path']}/{key['dtype']}", {})


def generation() -> int:
    """Bumped by ``forget_agreed``: exchanges made before are stale."""
    return _generation


def forget_agreed() -> None:
    """Make every group exchange the entries again on its next lookup (after a tuner wrote new ones)."""
    global _generation
    _generation += 1
