"""The tuner's edges, on one gloo rank with stand-ins for the GPU timings: ``tune bandwidth`` never times a message
larger than ``--max-mib`` (the P2P runner's buffers hold that much), refuses with the cache off before measuring,
and a missing curve is named with the exact command that measures it (its dtype and NCCL transport setting)."""

import pytest
import torch
import torch.distributed as dist

from flashoverlap.tune import cache, tuner
from flashoverlap.tune.model import Curve

GPU = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("max_mib", [100, 1, 3])
def test_the_curve_never_times_more_than_max_bytes(one_rank, monkeypatch, max_mib):
    monkeypatch.setattr(tuner, "time_ms", lambda call, **kw: (call(), 0.01)[1])
    target = tuner.Target(one_rank, torch.device("cpu"), torch.bfloat16)
    moved: list[int] = []
    curve = tuner.measure_curve("all_reduce", "p2p", target, max_mib << 20, lambda line: None, band=moved.append)
    assert max(moved) == moved[-1] == max_mib << 20  # the last size is max_bytes itself, never more
    assert list(curve.sizes) == moved == sorted(set(moved)) and moved[0] == tuner.MIN_CURVE_BYTES


def test_tune_bandwidth_refuses_with_the_cache_off_before_measuring(one_rank, monkeypatch):
    monkeypatch.setenv("FLASHOVERLAP_NO_CACHE", "1")
    measured = []
    monkeypatch.setattr(tuner, "measure_curve", lambda *a, **kw: measured.append(a))
    target = tuner.Target(one_rank, torch.device("cpu"), torch.bfloat16)
    with pytest.raises(RuntimeError, match="tune needs the cache: unset FLASHOVERLAP_NO_CACHE"):
        tuner.tune_bandwidth(["all_reduce"], "nccl", target, 1 << 20, lambda line: None)
    assert measured == []


@pytest.mark.parametrize("disabled", [True, False])
def test_a_missing_curve_names_the_command_that_stores_it_under_the_key_read(one_rank, tmp_path, monkeypatch,
                                                                           disabled):
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuner, "measure_machine", lambda *a, **kw: pytest.fail("measured without a curve"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {
        "multi_processor_count": 132}))
    bf16 = tuner.Target(one_rank, torch.device("cpu"), torch.bfloat16, disabled)
    tuner.store_curve(bf16.key("all_reduce", "nccl"), Curve((65536, 131072), (0.01, 0.02)))  # `tune bandwidth`
    fp16 = tuner.Target(one_rank, torch.device("cpu"), torch.float16, disabled)
    line = tuner.missing_curves("all_reduce", ["nccl"], fp16)
    setting = "NCCL_P2P_DISABLE=1 " if disabled else ""  # the transport is part of the key, as the dtype is
    command = "torchrun --nproc-per-node 1 -m flashoverlap tune bandwidth --path nccl --dtype float16 --ops all_reduce"
    assert f"`{setting}{command}`" in line, line
    assert tuner.missing_curves("all_reduce", ["nccl"], bf16) is None
    with pytest.raises(RuntimeError) as raised:
        tuner.model_search("all_reduce", (8192, 8192, 8192), fp16, {"nccl": None})
    assert str(raised.value) == line and cache.cache_dir() is not None
