"""The plan cache's edges: a bad entry (M <= 0, or a plan of another op, world size or shape) is skipped with one
warning and never fails a call; a file that is not this version's for its key is never replaced; what a tuner
could not store is said before it measures (``write_problem``)."""

import json
import warnings

import pytest

from flashoverlap.tune import cache
from flashoverlap.tune.defaults import default_plan

KEY = cache.cache_key("NVIDIA H100 80GB HBM3", 2, "all_reduce", "nccl", "bfloat16", False)


@pytest.fixture(autouse=True)
def cache_in(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHOVERLAP_NO_CACHE", raising=False)
    monkeypatch.setattr(cache, "_WARNED", set())
    return tmp_path / "cache"


def _plan(op="all_reduce", m=8192, n=8192, k=8192, world=2):
    return default_plan(op, m, n, k, world, num_sms=132, allow_sequential=False)


def _write(entries: dict, version: int = 1) -> None:
    path = cache.cache_file(KEY)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": version, "key": KEY, "entries": entries}))


@pytest.mark.parametrize("m", ["0", "-8192"])
def test_an_entry_of_m_zero_or_negative_is_skipped(m):
    _write({f"{m}x8192x8192": {"plan": _plan().to_dict()}, "6144x8192x8192": {"plan": _plan(m=6144).to_dict()}})
    near = cache.select(cache.load(KEY), "all_reduce", 6000, 8192, 8192, 2, 132)
    assert near is not None and near.m == 6000  # the valid entry nearby is still borrowed


@pytest.mark.parametrize("other", [dict(op="reduce_scatter"), dict(world=4), dict(m=4096)])
def test_an_exact_entry_whose_plan_is_anothers_is_skipped_with_one_warning(other):
    _write({"8192x8192x8192": {"plan": _plan(**other).to_dict()}})
    with pytest.warns(RuntimeWarning, match="entry '8192x8192x8192'"):
        assert cache.select(cache.load(KEY), "all_reduce", 8192, 8192, 8192, 2, 132) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert cache.select(cache.load(KEY), "all_reduce", 8192, 8192, 8192, 2, 132) is None


def test_a_borrowed_entry_whose_plan_is_anothers_is_skipped():
    _write({"8192x8192x8192": {"plan": _plan(op="reduce_scatter").to_dict()},
            "4096x8192x8192": {"plan": _plan(m=4096).to_dict()}})
    with pytest.warns(RuntimeWarning, match="reduce_scatter"):
        near = cache.select(cache.load(KEY), "all_reduce", 7000, 8192, 8192, 2, 132)
    assert near is not None and (near.op, near.m) == ("all_reduce", 7000)


@pytest.mark.parametrize("content", [json.dumps({"version": 2, "key": KEY, "entries": {"1x2x3": {"new": True}}}),
                                     "{not json"])
def test_a_file_not_of_this_version_is_never_replaced(content):
    path = cache.cache_file(KEY)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert "not replacing" in cache.write_problem(KEY)
    with pytest.raises(RuntimeError, match="not replacing plan cache file"):
        cache.store(KEY, _plan())
    assert path.read_text() == content


def test_write_problem_says_why_a_tuner_could_not_store(cache_in, monkeypatch):
    from flashoverlap import settings

    assert cache.write_problem(KEY) is None and cache_in.is_dir()
    cache.store(KEY, _plan())
    assert cache.write_problem(KEY) is None  # this version's file: merged into
    blocker = cache_in.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(blocker))
    settings.refresh()  # read once: read again
    assert "cannot be written" in cache.write_problem()
    monkeypatch.setenv("FLASHOVERLAP_NO_CACHE", "1")
    settings.refresh()
    assert cache.write_problem() == "tune needs the cache: unset FLASHOVERLAP_NO_CACHE"
