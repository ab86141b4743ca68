"""The plan cache: round trips, nearest-M selection, corrupt and foreign files, concurrent writers, the switches."""

import json
import os
import warnings

import pytest

from flashoverlap import settings
from flashoverlap.plan import Plan, TileConfig
from flashoverlap.testing import apply_environ, rank_context
from flashoverlap.tune import cache
from flashoverlap.tune.defaults import default_plan

KEY = cache.cache_key("NVIDIA H200", 2, "all_reduce", "nccl", "bfloat16")


@pytest.fixture(autouse=True)
def cache_in(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASHOVERLAP_NO_CACHE", raising=False)
    cache._WARNED.clear()
    return tmp_path


def _tuned(m=8192, n=8192, k=8192, **kw):
    return default_plan("all_reduce", m, n, k, 2, num_groups=5, profile="small-first", allow_sequential=False, **kw)


def test_plans_round_trip_through_dicts_and_files():
    for plan in (_tuned(), _tuned(tile=TileConfig(64, 128, 32, 4, 4, 4), num_programs=100, comm_ctas=8),
                 default_plan("all_gather", 4096, 4096, 4096, 2, path="p2p"),
                 default_plan("reduce_scatter", 256, 256, 256, 4)):
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    plan = _tuned()
    path = cache.store(KEY, plan, measured_ms=1.5, how="measured")
    assert path.name == "nvidia-h200-w2-all_reduce-nccl-bfloat16.json"
    entries = cache.load(KEY)
    assert cache.select(entries, "all_reduce", 8192, 8192, 8192, 2, 132) == plan
    assert entries["8192x8192x8192"]["measured_ms"] == 1.5


def test_a_shape_never_tuned_borrows_the_nearest_tuned_m():
    cache.store(KEY, _tuned(m=8192))
    cache.store(KEY, _tuned(m=2048, num_programs=100, comm_ctas=8))
    entries = cache.load(KEY)
    near = cache.select(entries, "all_reduce", 6000, 8192, 8192, 2, 132)
    assert (near.m, near.num_groups, near.grid_size) == (6000, 5, near.num_tiles)  # from 8192: one tile each
    small = cache.select(entries, "all_reduce", 1500, 8192, 8192, 2, 132)
    assert (small.grid_size, small.comm_ctas) == (100, 8)  # from 2048: persistent on 100 programs
    assert cache.select(entries, "all_reduce", 100000, 8192, 8192, 2, 132) is None  # too far from any
    assert cache.select(entries, "all_reduce", 8192, 4096, 8192, 2, 132) is None  # another N


def test_sequential_tuned_plans_stay_sequential_nearby():
    base = _tuned(m=4096)
    seq = Plan("all_reduce", 4096, 8192, 8192, 2, base.tile, (base.tiles_per_block,), 132, 0, True)
    cache.store(KEY, seq)
    assert cache.select(cache.load(KEY), "all_reduce", 3000, 8192, 8192, 2, 132).sequential


@pytest.mark.parametrize("content,why", [
    ("{not json", "unreadable"),
    ('{"version": 99, "entries": {}}', "not a version-1"),
    (json.dumps({"version": 1, "key": cache.cache_key("A100", 2, "all_reduce", "nccl", "bfloat16"),
                 "entries": {}}), "describes"),
])
def test_corrupt_or_foreign_files_are_reported_once_and_ignored(content, why):
    cache.cache_file(KEY).parent.mkdir(parents=True, exist_ok=True)
    cache.cache_file(KEY).write_text(content)
    with pytest.warns(RuntimeWarning, match=why):
        assert cache.load(KEY) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.load(KEY) == {}  # reported once
    with pytest.raises(RuntimeError, match="not replacing"):  # another install's, or one to look at: kept
        cache.store(KEY, _tuned())
    assert cache.cache_file(KEY).read_text() == content


def test_an_invalid_entry_is_skipped():
    cache.store(KEY, _tuned())
    path = cache.cache_file(KEY)
    data = json.loads(path.read_text())
    data["entries"]["8192x8192x8192"]["plan"]["group_row_tiles"] = [1, 2]
    path.write_text(json.dumps(data))
    assert cache.select(cache.load(KEY), "all_reduce", 8192, 8192, 8192, 2, 132) is None


def _write_many(args):
    directory, first = args
    os.environ["FLASHOVERLAP_CACHE_DIR"] = directory
    settings.refresh()  # read once: read again
    for m in range(first, first + 10):
        cache.store(KEY, default_plan("all_reduce", 128 * m, 1024, 1024, 2, allow_sequential=False))


def test_concurrent_writers_lose_nothing(cache_in):
    with rank_context().Pool(4, initializer=apply_environ, initargs=(dict(os.environ),)) as pool:
        pool.map(_write_many, [(str(cache_in), 1 + 10 * i) for i in range(4)])
    assert len(cache.load(KEY)) == 40


def test_the_cache_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("FLASHOVERLAP_NO_CACHE", "1")
    settings.refresh()
    assert cache.cache_dir() is None and cache.store(KEY, _tuned()) is None and cache.load(KEY) == {}


def _agree(rank, world_size, base):
    import os

    import torch.distributed as dist

    os.environ["FLASHOVERLAP_CACHE_DIR"] = f"{base}/{rank}"  # every rank its own cache: rank 0's wins

    settings.refresh()  # read once: read again
    if rank == 0:
        cache.store(KEY, _tuned())
    else:
        cache.store(KEY, _tuned(num_programs=64))
    every = cache.exchange_entries(dist.group.WORLD, KEY["gpu"], KEY["world_size"])
    entries = cache.entries_for(every, KEY)
    other = cache.entries_for(every, {**KEY, "op": "all_gather"})
    return cache.select(entries, "all_reduce", 8192, 8192, 8192, KEY["world_size"], 132).grid_size, other


def test_ranks_agree_on_rank_zeros_entries(cache_in):
    from flashoverlap.testing import spawn

    results = spawn(_agree, 3, args=(str(cache_in),))
    assert [r[0] for r in results] == [_tuned().grid_size] * 3
    assert all(r[1] == {} for r in results)


def test_nccl_through_host_memory_has_its_own_cache(monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    nvlink = cache.cache_key("NVIDIA H200", 2, "all_reduce", "nccl", "bfloat16")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    settings.refresh()  # the environment is read once: read it again
    host = cache.cache_key("NVIDIA H200", 2, "all_reduce", "nccl", "bfloat16")
    assert host != nvlink and cache.cache_file(host).name.endswith("-nccl-p2p-disabled.json")
    cache.store(host, _tuned())
    assert cache.load(host) and not cache.load(nvlink)


def test_the_transport_is_the_callers_value_where_given(monkeypatch):
    # The runtime passes its read-once setting: the environment of the moment does not override it.
    for env in ("1", "0"):
        monkeypatch.setenv("NCCL_P2P_DISABLE", env)
        settings.refresh()
        host = cache.cache_key("NVIDIA H200", 2, "all_reduce", "nccl", "bfloat16", nccl_p2p_disabled=True)
        nvlink = cache.cache_key("NVIDIA H200", 2, "all_reduce", "nccl", "bfloat16", nccl_p2p_disabled=False)
        assert host["nccl_p2p"] == "disabled" and "nccl_p2p" not in nvlink
    # exchange_entries looks its entries up under the caller's transport too (one rank: nothing to send).
    monkeypatch.setattr(cache.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(cache.dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(cache.dist, "broadcast_object_list", lambda box, src, group: None)
    cache.store(host, _tuned())
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    settings.refresh()
    every = cache.exchange_entries(None, "NVIDIA H200", 2, nccl_p2p_disabled=True)
    assert cache.entries_for(every, host) == cache.load(host) != {}
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    settings.refresh()
    assert cache.exchange_entries(None, "NVIDIA H200", 2, nccl_p2p_disabled=False) == {}
    assert cache.exchange_entries(None, "NVIDIA H200", 2) != {}  # no value given: the environment's


def test_a_borrowed_plan_keeps_its_cublas_bands():
    cache.store(KEY, _tuned(m=8192, gemm="cublas"))
    near = cache.select(cache.load(KEY), "all_reduce", 6000, 8192, 8192, 2, 132)
    assert near.gemm == "cublas" and near.num_groups == 5


def _agree_auto(rank, world_size, root):
    import os

    import torch.distributed as dist

    os.environ["FLASHOVERLAP_CACHE_DIR"] = root

    settings.refresh()  # read once: read again
    auto = {**KEY, "path": "auto"}
    if rank == 0:
        cache.store(auto, default_plan("all_reduce", 8192, 8192, 8192, 2, num_groups=3, path="p2p",
                                       allow_sequential=False))
    entries = cache.entries_for(cache.exchange_entries(dist.group.WORLD, KEY["gpu"], KEY["world_size"]), auto)
    plan = cache.select(entries, "all_reduce", 8192, 8192, 8192, world_size, 132)
    return plan.path, plan.sub_bands


def test_plans_tuned_for_path_auto_are_exchanged_and_keep_their_path(cache_in):
    from flashoverlap.testing import spawn

    assert spawn(_agree_auto, 2, args=(str(cache_in),)) == [("p2p", 3)] * 2
