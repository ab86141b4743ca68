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


# -- a group that is not NCCL, with CUDA tensors (ranks sharing one GPU over gloo) -----------------------------------


def _gloo(**kwargs):
    request = _request(**kwargs)
    return Request(request.device, request.dtype, request.world_size, request.plan, request.p2p_reason,
                   request.nccl_p2p_disabled, "gloo")


def _facts(request, op="all_reduce", shape=(8192, 8192, 8192), tuned=None, rates=None, asked=None):
    from flashoverlap.tune.rates import Rates

    def rates_of(dtype):
        if asked is not None:
            asked.append(dtype)
        return rates or Rates(700.0, 200.0)

    return policy.Facts(op, shape, request, 132, lambda path: (tuned or {}).get(path), rates_of)


def test_on_a_gloo_group_with_cuda_tensors_only_p2p_applies():
    """P2P moves no bytes through the group's backend, so a gloo group may bootstrap it; every other path (and a
    sequential plan's collective) moves its bytes through the backend and raises today's clear error."""
    assert reason_not("p2p", _gloo()) is None
    assert "spans 2 hosts" in reason_not("p2p", _gloo(verdict="the group spans 2 hosts"))
    for path in ("nccl", "ring", "reference"):
        why = reason_not(path, _gloo())
        assert why.startswith("group has backend 'gloo' but the tensors are on cuda:0; CUDA tensors need an NCCL "
                              "group (init_process_group('nccl') or new_group(backend='nccl'))"), (path, why)
    sequential = sequential_plan("all_reduce", 64, 64, 64, 2, path="p2p")
    assert "CUDA tensors need an NCCL group" in reason_not("p2p", _gloo(plan=sequential))
    # On the CPU gloo moves everything, and on CUDA an NCCL group does: the rule changes nothing there.
    for path in ("nccl", "p2p", "ring", "reference"):
        assert reason_not(path, _request(device=CPU)) == reason_not(path, _gloo(device=CPU))
        assert reason_not(path, _request()) is None
    assert explicit_path("op", "p2p", _gloo()) == "p2p"
    for path in ("nccl", "ring", "reference"):
        with pytest.raises(ValueError, match=r"^op: group has backend 'gloo' .* CUDA tensors need an NCCL group"):
            explicit_path("op", path, _gloo())
    with pytest.raises(ValueError, match="CUDA tensors need an NCCL group"):  # float32: the sequential plan
        explicit_path("op", "auto", _gloo(dtype=torch.float32))


def test_auto_on_a_gloo_group_takes_p2p_where_the_verdict_allows_and_raises_otherwise():
    path, plan, why = policy.decide("op", "auto", _facts(_gloo()))
    assert path == "p2p" and plan.path == "p2p" and not plan.sequential and "one node" in why
    for gloo, reason in ((_gloo(verdict="rank 1's GPU 1 cannot access the memory of rank 0's GPU 0"), "cannot access"),
                         (_gloo(world_size=16), "16 ranks")):
        with pytest.raises(ValueError, match=rf"^op: group has backend 'gloo' .*NCCL group.*path='auto' cannot take "
                                             rf"the P2P path here: .*{reason}"):
            policy.decide("op", "auto", _facts(gloo))
    disabled = _gloo()
    disabled = Request(*(getattr(disabled, f) for f in ("device", "dtype", "world_size", "plan", "p2p_reason")),
                       nccl_p2p_disabled=True, backend="gloo")
    with pytest.raises(ValueError, match="NCCL_P2P_DISABLE=1 is set"):
        policy.decide("op", "auto", _facts(disabled))
    # A plan tuned for NCCL cannot serve the group: P2P's default plan instead; one tuned for P2P does.
    nccl = default_plan("all_reduce", 8192, 8192, 8192, 2)
    p2p = default_plan("all_reduce", 8192, 8192, 8192, 2, path="p2p", num_groups=4)
    assert policy.decide("op", "auto", _facts(_gloo(), tuned={"auto": nccl}))[:2] == ("p2p", default_plan(
        "all_reduce", 8192, 8192, 8192, 2, path="p2p"))
    assert policy.decide("op", "auto", _facts(_gloo(), tuned={"auto": p2p}))[1] is p2p
    # Small shapes overlap all the same (on NCCL they would run sequentially): no collective to fall back on.
    for op in ("reduce_scatter", "all_gather"):
        assert not policy.decide("op", "auto", _facts(_gloo(), op=op, shape=(16, 64, 64)))[1].sequential
        assert policy.decide("op", "auto", _facts(_request(), op=op, shape=(16, 64, 64)))[1].sequential
    # Where the ring all-reduce cannot split the shape, its plan is sequential, whose collective needs NCCL.
    with pytest.raises(ValueError, match=r"too small to overlap on path 'p2p', so its plan is sequential; group has "
                                         r"backend 'gloo'"):
        policy.decide("op", "auto", _facts(_gloo(), shape=(16, 64, 64)))
    # fp32 would run sequentially: the clear error, before anything is asked.
    asked = []
    with pytest.raises(ValueError, match="CUDA tensors need an NCCL group"):
        policy.decide("op", "auto", _facts(_gloo(dtype=torch.float32, asked=asked)))
    assert not asked


def test_expert_calls_on_a_gloo_group_with_cuda_tensors():
    def expert(device=CUDA, dtype=torch.bfloat16, world_size=2, verdict=None, backend="gloo", disabled=False):
        return policy.ExpertRequest(device, dtype, world_size, frozenset({"reference", "nccl", "p2p"}),
                                    lambda: verdict, disabled, backend)

    assert policy.expert_path("op", "p2p", expert()) == ("p2p", "asked for")
    assert policy.expert_path("op", "auto", expert())[0] == "p2p"
    for path in ("nccl", "reference"):
        with pytest.raises(ValueError, match=r"^op: group has backend 'gloo' .* CUDA tensors need an NCCL group"):
            policy.expert_path("op", path, expert())
    with pytest.raises(ValueError, match="path='auto' cannot take the P2P path here: .*no peer access"):
        policy.expert_path("op", "auto", expert(verdict="no peer access"))
    with pytest.raises(ValueError, match="path='auto' cannot take the P2P path here: NCCL_P2P_DISABLE"):
        policy.expert_path("op", "auto", expert(disabled=True))
    # NCCL groups and the CPU as before.
    assert policy.expert_path("op", "auto", expert(backend="nccl", verdict="no peer access"))[0] == "nccl"
    assert policy.expert_path("op", "auto", expert(device=CPU))[0] == "reference"
    assert policy.expert_path("op", "reference", expert(device=CPU))[0] == "reference"


# -- the plan, decided with the path in one pass -----------------------------------------------------------------------


def test_decide_picks_the_path_and_the_plan_in_one_pass():
    asked = []
    # NCCL: the default plan sized by the group's rates (asked only here), a given plan's path, the tuned plan.
    path, plan, why = policy.decide("op", "nccl", _facts(_request(), asked=asked))
    assert (path, why) == ("nccl", None) and plan == default_plan(
        "all_reduce", 8192, 8192, 8192, 2, num_sms=132, element_size=2,
        comm_ratio=round(2 * 0.5 * 8192 * 8192 * 2 / 200e6 / (2 * 8192**3 / 700e9), 2))
    assert asked == [torch.bfloat16]
    path, plan, why = policy.decide("op", "auto", _facts(_request(), asked=asked))
    assert path == "p2p" and plan.path == "p2p" and asked == [torch.bfloat16]  # P2P needs no rates
    assert policy.decide("op", "auto", _facts(_request(verdict="no peer access")))[0] == "nccl"
    given = default_plan("all_reduce", 8192, 8192, 8192, 2, path="p2p")
    assert policy.decide("op", "auto", _facts(_request(plan=given))) == ("p2p", None, None)
    tuned = default_plan("all_reduce", 8192, 8192, 8192, 2, num_groups=3)
    assert policy.decide("op", "nccl", _facts(_request(), tuned={"nccl": tuned}))[1] is tuned
    assert policy.decide("op", "auto", _facts(_request(), tuned={"auto": tuned}))[:2] == ("nccl", tuned)
    # float32 on CUDA: sequential; the CPU: the reference path with a default plan (no tuned plans, no rates).
    assert policy.decide("op", "auto", _facts(_request(dtype=torch.float32)))[1].sequential
    path, plan, _ = policy.decide("op", "auto", _facts(_request(device=CPU), asked=asked))
    assert path == "reference" and plan == default_plan("all_reduce", 8192, 8192, 8192, 2) and len(asked) == 1


def test_the_expert_ops_say_once_per_group_which_path_auto_took_and_why(caplog):
    # As the tensor-parallel ops do: a CUDA call with path="auto" logs the path taken and why, once per group's
    # context; a named path and a CPU call log nothing.
    import types

    from flashoverlap.runtime import experts

    def context(device):
        return types.SimpleNamespace(device=torch.device(device), world_size=2, p2p_reason=lambda: "no peer access",
                                     backend="nccl", name="group 7", logged=set())

    gpu, cpu = context("cuda"), context("cpu")
    with caplog.at_level("DEBUG", logger="flashoverlap"):
        for _ in range(2):
            assert experts._expert_path("moe_dispatch_gemm", "auto", gpu, torch.bfloat16, False) == "nccl"
        assert experts._expert_path("moe_dispatch_gemm", "nccl", context("cuda"), torch.bfloat16, False) == "nccl"
        assert experts._expert_path("moe_dispatch_gemm", "auto", cpu, torch.bfloat16, False) == "reference"
    said = [r.getMessage() for r in caplog.records if r.name == "flashoverlap" and r.levelname == "DEBUG"]
    assert said == ["flashoverlap: path='auto' uses nccl for the expert ops on group 7: path='p2p' cannot apply to "
                    "this group: no peer access; use path='nccl'"]
