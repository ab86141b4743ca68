"""The path rules (``runtime/policy.py``), pure: one predicate per path and what path="auto" picks, from what every
rank observed (the observation itself needs GPUs)."""

import pytest
import torch

from flashoverlap.runtime import policy
from flashoverlap.runtime.policy import Request, automatic_path, explicit_path, reason_not
from flashoverlap.tune.defaults import default_plan, sequential_plan

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _request(device=CUDA, dtype=torch.bfloat16, world_size=2, plan=None, verdict=None, asked=None):
    def p2p_reason():
        if asked is not None:
            asked.append(True)
        return verdict

    return Request(device, dtype, world_size, plan, p2p_reason)


def test_auto_picks_p2p_where_it_applies():
    assert automatic_path(None, 2) == ("p2p", automatic_path(None, 8)[1])
    path, why = automatic_path("the group spans 2 hosts (a, b)", 2)
    assert path == "nccl" and "spans 2 hosts" in why
    path, why = automatic_path(None, 16)
    assert path == "nccl" and "16 ranks" in why
    path, why = automatic_path(None, 2, nccl_p2p_disabled=True)
    assert path == "nccl" and "NCCL_P2P_DISABLE" in why


def test_a_tuned_auto_plan_decides_the_path_where_it_applies():
    p2p = default_plan("reduce_scatter", 4096, 4096, 4096, 2, path="p2p")
    nccl = default_plan("all_gather", 4096, 4096, 4096, 2)
    assert automatic_path(None, 2, tuned=p2p)[0] == "p2p"  # measured, not the rule
    assert automatic_path(None, 2, tuned=nccl)[0] == "nccl"
    # A tuned P2P plan cannot apply where P2P does not: the rule decides, naming why.
    path, why = automatic_path("the group spans 2 hosts (a, b)", 2, tuned=p2p)
    assert path == "nccl" and "spans 2 hosts" in why
    path, why = automatic_path(None, 2, nccl_p2p_disabled=True, tuned=p2p)
    assert path == "nccl" and "NCCL_P2P_DISABLE" in why


def test_each_path_says_why_it_cannot_apply():
    assert reason_not("reference", _request(device=CPU, dtype=torch.float64)) is None
    assert "needs CUDA" in reason_not("nccl", _request(device=CPU))
    assert "needs CUDA" in reason_not("p2p", _request(device=CPU))
    assert reason_not("ring", _request(device=CPU)) is None  # send/recv: gloo has them
    assert "up to 8" in reason_not("p2p", _request(world_size=16))
    assert "spans 2 hosts" in reason_not("p2p", _request(verdict="the group spans 2 hosts"))
    assert reason_not("p2p", _request()) is None and reason_not("nccl", _request()) is None
    # float32 on CUDA: the sequential plan (or none, which the runtime makes sequential); no overlapped path.
    fp32 = torch.float32
    assert reason_not("nccl", _request(dtype=fp32)) is None
    assert reason_not("nccl", _request(dtype=fp32, plan=sequential_plan("all_reduce", 64, 64, 64, 2))) is None
    overlapped = default_plan("all_reduce", 8192, 8192, 8192, 2, allow_sequential=False)
    assert "float32 runs only" in reason_not("nccl", _request(dtype=fp32, plan=overlapped))
    assert "float32 runs only" in reason_not("p2p", _request(dtype=fp32))
    assert "float32 runs only" in reason_not("ring", _request(dtype=fp32))


def test_the_p2p_verdict_is_asked_only_where_a_rule_needs_it():
    asked = []
    reason_not("p2p", _request(device=CPU, asked=asked))
    reason_not("p2p", _request(world_size=16, asked=asked))
    reason_not("nccl", _request(asked=asked))
    assert not asked  # the first ask is collective: only a P2P call on CUDA may make it
    reason_not("p2p", _request(asked=asked))
    assert asked == [True]


def test_explicit_paths():
    plan = default_plan("all_reduce", 8192, 8192, 8192, 2, path="p2p")
    assert explicit_path("op", "auto", _request()) == "auto"  # automatic_path decides
    assert explicit_path("op", "auto", _request(plan=plan)) == "p2p"  # the plan's path
    assert explicit_path("op", "auto", _request(device=CPU)) == "reference"
    assert explicit_path("op", "auto", _request(dtype=torch.float32)) == "nccl"
    with pytest.raises(ValueError, match="path must be one of"):
        explicit_path("op", "fast", _request())
    with pytest.raises(ValueError, match="the plan given is for path 'p2p'"):
        explicit_path("op", "nccl", _request(plan=plan))
    with pytest.raises(ValueError, match="op: path='p2p' cannot apply to this group: no peer access"):
        explicit_path("op", "p2p", _request(verdict="no peer access"))
    assert policy.CALL_PATHS == ("auto", "nccl", "p2p", "ring", "reference")


def test_fp8_takes_the_overlapped_paths_that_run_it_and_names_the_others():
    e4m3 = torch.float8_e4m3fn
    overlapped = default_plan("all_reduce", 8192, 8192, 8192, 2, allow_sequential=False)
    for path in ("nccl", "p2p", "ring"):
        why = reason_not(path, _request(dtype=e4m3, plan=overlapped if path == "nccl" else None))
        if path in policy.FP8_PATHS:
            assert why is None, (path, why)
        else:
            assert f"path={path!r} does not run fp8" in why and "nccl" in why
    assert explicit_path("op", "auto", _request(dtype=e4m3)) == "auto"  # not the float32 rule: automatic_path decides
    assert automatic_path(None, 2, fp8=True)[0] == ("p2p" if "p2p" in policy.FP8_PATHS else "nccl")
    assert automatic_path("no peer access", 2, fp8=True)[0] == "nccl"
    assert policy.FP8_PATHS[0] == "nccl"
