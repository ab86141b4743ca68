"""The runtime's dispatch (``runtime/calls.py``): every call reaches the communicator the table names with a
``Call`` resolved once (the debug deadline and the replay verdict included), and every communicator follows the one
protocol (``comm/protocol.py``)."""

import contextlib
import dataclasses
import inspect
import tempfile

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap import guards, settings
from flashoverlap.comm.protocol import Call, Communicator, NoLane
from flashoverlap.runtime import context as context_module
from flashoverlap.runtime import policy
from flashoverlap.runtime.context import COMMUNICATORS, context_of
from flashoverlap.tune.defaults import sequential_plan


@pytest.fixture
def world_of_one():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            yield context_of(dist.group.WORLD, torch.device("cpu"))
        finally:
            fo.release()
            dist.destroy_process_group()


class Recording(NoLane):
    """A communicator that records the calls it is given and answers with the plain product."""

    path = "recording"

    def __init__(self, group):
        self.group, self.calls = group, []

    def run(self, call):
        self.calls.append(call)
        return call.a @ call.b, None

    def release(self):
        pass


def _install(context, key):
    recording = Recording(context.group)
    context.communicators[key] = recording
    return recording


def test_a_call_reaches_its_communicator_with_the_settings_read_once(world_of_one, monkeypatch):
    reference = _install(world_of_one, ("gemm", "reference"))
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    monkeypatch.delenv("FLASHOVERLAP_DEBUG_TIMEOUT", raising=False)
    monkeypatch.delenv("FLASHOVERLAP_REPLAY", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    settings.refresh()  # the settings are read once, at the next call
    hook = lambda: None  # noqa: E731
    fo.gemm_all_reduce(a, b)
    from flashoverlap.runtime.calls import GEMM, GemmSpec, execute

    execute(GEMM, GemmSpec("name", "all_reduce", a, b, None, None, "auto", hook=hook))
    first, second = reference.calls
    assert isinstance(first, Call) and first.plan.op == "all_reduce" and first.a is a and first.b is b
    assert first.name == "gemm_all_reduce" and first.replay and first.timeout is None and first.hook is None
    assert second.hook is hook and second.name == "name"


def test_the_settings_are_read_once_and_again_after_refresh(world_of_one, monkeypatch):
    reference = _install(world_of_one, ("gemm", "reference"))
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    monkeypatch.delenv("FLASHOVERLAP_REPLAY", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    settings.refresh()
    fo.gemm_all_reduce(a, b)
    monkeypatch.setenv("FLASHOVERLAP_REPLAY", "0")
    fo.gemm_all_reduce(a, b)  # no environment read on this call
    settings.refresh()
    fo.gemm_all_reduce(a, b)
    assert [call.replay for call in reference.calls] == [True, True, False]
    settings.refresh()


def test_no_replay_and_no_deadline_inside_a_users_capture(world_of_one, monkeypatch):
    reference = _install(world_of_one, ("gemm", "reference"))
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    monkeypatch.delenv("FLASHOVERLAP_REPLAY", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    settings.refresh()
    fo.gemm_all_reduce(a, b)
    monkeypatch.setattr(guards, "capturing", lambda *operand: True)
    fo.gemm_all_reduce(a, b)
    outside, inside = reference.calls
    assert outside.replay and not inside.replay, "a call inside a user's capture must be captured, not replayed"


@pytest.mark.parametrize("connections", [None, "8", "1"])
def test_inside_a_users_capture_on_one_queue_the_nccl_reductions_wait_on_edges(world_of_one, monkeypatch,
                                                                                connections):
    # CUDA_DEVICE_MAX_CONNECTIONS=1: a reduction whose signalling GEMM bumps counters runs as cuBLAS bands inside a
    # user's capture (runtime/policy.captured_plan); eagerly, and with more queues, it keeps its plan.
    from flashoverlap.tune.defaults import default_plan

    nccl = _install(world_of_one, ("gemm", "nccl"))
    monkeypatch.setattr(policy, "reason_not", lambda path, request: None)  # the NCCL path, on a CPU group
    a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16)
    if connections is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    settings.refresh()
    try:
        plans = {op: default_plan(op, 64, 48, 32, 1, num_groups=2, gemm=gemm, allow_sequential=False)
                 for op, gemm in (("all_reduce", "triton"), ("reduce_scatter", "triton"), ("all_gather", "triton"),
                                  ("all_reduce", "cublas"))}
        ops = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter,
               "all_gather": fo.all_gather_gemm}
        for plan in plans.values():
            ops[plan.op](a, b, path="nccl", plan=plan)
        monkeypatch.setattr(guards, "capturing", lambda *operand: True)
        for plan in plans.values():
            ops[plan.op](a, b, path="nccl", plan=plan)
    finally:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        settings.refresh()
    eager, captured = nccl.calls[: len(plans)], nccl.calls[len(plans):]
    assert [call.plan for call in eager] == list(plans.values())
    for plan, call in zip(plans.values(), captured):
        banded = connections == "1" and plan.counts_tiles
        want = dataclasses.replace(plan, gemm="cublas") if banded else plan
        assert call.plan == want, (connections, plan.op, plan.gemm, call.plan.gemm)
        assert call.plan.groups == plan.groups  # the same bands, multiplied by cuBLAS


def test_a_sequential_plan_runs_the_sequential_communicator_on_any_path(world_of_one):
    sequential = _install(world_of_one, ("gemm", "sequential"))
    ring = _install(world_of_one, ("gemm", "ring"))
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    plan = sequential_plan("all_reduce", 8, 6, 4, 1, path="ring")
    fo.gemm_all_reduce(a, b, plan=plan, path="ring")
    assert len(sequential.calls) == 1 and not ring.calls


def test_a_sequential_plan_carries_no_deadline_and_replays_where_the_runtime_allows(world_of_one, monkeypatch):
    # The sequential communicator waits on nothing: its calls carry no deadline, in debug mode too. Its repeated
    # calls replay like the other paths' (host time of every decode-sized call): the replay verdict is the runtime's
    # (off in debug mode and inside a user's capture).
    sequential = _install(world_of_one, ("gemm", "sequential"))
    monkeypatch.setenv("FLASHOVERLAP_DEBUG_TIMEOUT", "5")
    settings.refresh()
    inside = []

    def capturing(operand=None):
        return bool(inside) and operand is not None

    monkeypatch.setattr(guards, "capturing", capturing)
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    plan = sequential_plan("all_reduce", 8, 6, 4, 1, path="ring")
    fo.gemm_all_reduce(a, b, plan=plan, path="ring")
    monkeypatch.delenv("FLASHOVERLAP_DEBUG_TIMEOUT")  # outside debug mode, where calls may be replayed
    monkeypatch.delenv("FLASHOVERLAP_REPLAY", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    settings.refresh()
    assert settings.current().replay
    fo.gemm_all_reduce(a, b, plan=plan, path="ring")
    inside.append(True)  # inside a user's capture: captured there, never replayed
    fo.gemm_all_reduce(a, b, plan=plan, path="ring")
    debug, plain, captured = sequential.calls
    assert debug.timeout is None and not debug.replay
    assert plain.timeout is None and plain.replay
    assert captured.timeout is None and not captured.replay


def test_a_sequential_call_asks_the_device_question_only_where_a_hook_may_allocate(world_of_one, monkeypatch):
    # The sequential communicator names a's device in every allocation and has no stream of its own, so the
    # runtime skips the current-device check (host time); a hook is arbitrary code and runs on a's device.
    sequential = _install(world_of_one, ("gemm", "sequential"))
    asked = []
    monkeypatch.setattr(guards, "on_current_device", lambda operand: asked.append(operand) or True)
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    plan = sequential_plan("all_reduce", 8, 6, 4, 1, path="ring")
    fo.gemm_all_reduce(a, b, plan=plan, path="ring")
    assert not asked and len(sequential.calls) == 1
    from flashoverlap.runtime.calls import GEMM, GemmSpec, execute

    execute(GEMM, GemmSpec("name", "all_reduce", a, b, None, plan, "ring", hook=lambda: None))
    assert asked == [a] and len(sequential.calls) == 2


def test_on_current_device_compares_with_the_current_cuda_device(monkeypatch):
    class OnDevice:  # a CUDA tensor's is_cuda and get_device(), without CUDA
        is_cuda = True

        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)  # absent from CPU builds
    assert guards.on_current_device(torch.zeros(1))  # the CPU: never a device switch
    assert guards.on_current_device(OnDevice(1)) and not guards.on_current_device(OnDevice(0))


def test_every_communicator_follows_the_protocol():
    gemm_kinds = [key for key in COMMUNICATORS if key[0] == "gemm"]
    assert {path for _, path in gemm_kinds} == {"reference", "sequential", "nccl", "p2p", "ring"}
    for key, build in COMMUNICATORS.items():
        assert build.path == key[1], f"{build.__name__}.path is {build.path!r}, the table says {key[1]!r}"
        assert list(inspect.signature(build.__init__).parameters) == ["self", "group"], build
        assert list(inspect.signature(build.run).parameters) == ["self", "call"], build
        assert callable(build.release), build
        assert list(inspect.signature(build.replayer).parameters) == ["self", "call"], build
        for member in ("run", "replayer", "release"):
            assert member in vars(Communicator) and hasattr(build, member)
    assert context_module._HOLD_NOTHING <= set(COMMUNICATORS)


def test_a_repeated_call_is_resolved_once_and_anything_else_afresh(world_of_one, monkeypatch):
    """The fast path (``context.REGISTRY``): a call whose whole signature was resolved before skips the operand
    checks; another shape, dtype, path or plan is checked again; a release forgets every answer."""
    from flashoverlap.runtime import calls

    reference = _install(world_of_one, ("gemm", "reference"))
    checked = []
    check = calls.check_operands
    monkeypatch.setattr(calls, "check_operands", lambda *args: checked.append(args[1].shape) or check(*args))
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    torch.testing.assert_close(fo.gemm_all_reduce(a, b), a @ b)
    first = len(checked)  # a first call's checks (the agreement's and the resolution's)
    assert first >= 1
    for _ in range(2):
        torch.testing.assert_close(fo.gemm_all_reduce(a, b), a @ b)
    assert len(checked) == first and len(reference.calls) == 3
    assert reference.calls[2].plan is reference.calls[0].plan
    for other in ((torch.randn(10, 4, dtype=torch.bfloat16), b), (a.half(), b.half())):  # another M, dtype
        fo.gemm_all_reduce(*other)
        assert len(checked) > first
        first = len(checked)
    fo.gemm_all_reduce(a, b, path="reference")  # another path
    assert len(checked) > first
    with pytest.raises(ValueError, match="K differ"):  # bad operands are never answered from the cache
        fo.gemm_all_reduce(a, torch.randn(5, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K differ"):
        fo.gemm_all_reduce(a, torch.randn(5, 6, dtype=torch.bfloat16))
    assert context_module.REGISTRY.resolved
    fo.release()
    assert not context_module.REGISTRY.resolved
    _install(context_of(dist.group.WORLD, torch.device("cpu")), ("gemm", "reference"))
    before = len(checked)
    fo.gemm_all_reduce(a, b)
    assert len(checked) > before


def test_a_first_call_is_agreed_once_and_never_inside_a_capture(world_of_one, monkeypatch):
    """Without a switch the ranks agree on a call the group has not agreed on, before its collectives: once per
    call (a registry miss on a row agreed before exchanges nothing: the registry may forget on one rank and not on
    another), and never inside a CUDA-graph capture."""
    from flashoverlap.runtime import agreement

    _install(world_of_one, ("gemm", "reference"))
    for variable in ("TORCH_DISTRIBUTED_DEBUG", "FLASHOVERLAP_DEBUG_TIMEOUT"):
        monkeypatch.delenv(variable, raising=False)
    settings.refresh()
    exchanged = []
    real = agreement.gather_rows
    monkeypatch.setattr(agreement, "gather_rows", lambda *args: exchanged.append(args[0]) or real(*args))
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    monkeypatch.setattr(guards, "capturing", lambda operand=None: True)
    fo.gemm_all_reduce(a, b)
    assert not exchanged and not world_of_one.agreed_rows  # captured: nothing exchanged, nothing taken as agreed
    monkeypatch.undo()
    monkeypatch.setattr(agreement, "gather_rows", lambda *args: exchanged.append(args[0]) or real(*args))
    fo.gemm_all_reduce(a, b[:, :5])  # another N: a new call
    assert exchanged == ["gemm_all_reduce"] and len(world_of_one.agreed_rows) == 1
    fo.gemm_all_reduce(a, b[:, :5])
    context_module.REGISTRY.resolved.clear()  # this rank forgets its resolved calls; the group's agreement stays
    fo.gemm_all_reduce(a, b[:, :5].contiguous())
    assert exchanged == ["gemm_all_reduce"]


class Laned(Recording):
    """A recording communicator whose calls take the replay lane: its replayer answers ``("lane", n)`` while
    ``graph`` says a graph is held, else None (the runtime then runs the call)."""

    def __init__(self, group):
        super().__init__(group)
        self.built, self.lane_calls, self.graph = [], 0, True

    def replayer(self, call):
        if not call.replay:
            return None
        self.built.append(call)

        def again(spec):
            if not self.graph:
                return None
            self.lane_calls += 1
            return ("lane", self.lane_calls), None

        return again


def _laned(context, key, cls, monkeypatch):
    """A laned recording communicator (``cls``) installed under ``key``, with every switch that turns lanes off
    unset."""
    laned = _install(context, key)
    laned.__class__ = cls
    cls.__init__(laned, context.group)
    for variable in ("FLASHOVERLAP_DEBUG_TIMEOUT", "FLASHOVERLAP_REPLAY", "CUDA_DEVICE_MAX_CONNECTIONS",
                     "TORCH_DISTRIBUTED_DEBUG"):
        monkeypatch.delenv(variable, raising=False)
    settings.refresh()
    return laned


def test_a_call_on_the_tensors_of_a_replayed_call_takes_the_lane_and_nothing_else_does(world_of_one, monkeypatch):
    """The replay lane (``execute``): a call reading the same tensors, laid out the same, with the same plan, path,
    group and settings as one its communicator replayed is its replayer's answer alone; any difference, a capture,
    another device, a hook, debug mode or replay switched off runs the call; a replayer that holds no graph sends
    the call on to the communicator, which builds it again; ``release`` forgets every lane."""
    from flashoverlap.runtime.calls import GEMM, GemmSpec, execute

    laned = _laned(world_of_one, ("gemm", "reference"), Laned, monkeypatch)
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    torch.testing.assert_close(fo.gemm_all_reduce(a, b), a @ b)  # run; its replayer kept
    assert len(laned.calls) == 1 and len(laned.built) == 1
    assert fo.gemm_all_reduce(a, b) == ("lane", 1) and len(laned.calls) == 1  # the lane alone
    assert fo.gemm_all_reduce(a, b) == ("lane", 2)
    calls = len(laned.calls)
    others = [
        lambda: fo.gemm_all_reduce(a.clone(), b),  # another a
        lambda: fo.gemm_all_reduce(a, b.clone()),  # another b
        lambda: fo.gemm_all_reduce(a[:, :4], b),  # the same a as a view: the same address and layout
        lambda: fo.gemm_all_reduce(a.t().contiguous().t(), b),  # a laid out otherwise
        lambda: fo.gemm_all_reduce(a, b, path="reference"),  # another path
        lambda: fo.gemm_all_reduce(a, b, plan=sequential_plan("all_reduce", 8, 6, 4, 1)),  # another plan
        lambda: fo.gemm_reduce_scatter(a, b),  # another op on the same tensors
        lambda: execute(GEMM, GemmSpec("gemm_all_reduce", "all_reduce", a, b, None, None, "auto",
                                       hook=lambda: None)),  # a hook
    ]
    for i, other in enumerate(others):
        lanes = laned.lane_calls
        result = other()
        if i == 2:  # a view with a's address, shape and strides reads what a reads: the lane is right to answer
            assert result == ("lane", lanes + 1)
            continue
        assert laned.lane_calls == lanes and len(laned.calls) == calls + 1, i
        calls += 1
    # a capture, another device, debug mode, replay off: run (with no lane built where the call does not replay)
    monkeypatch.setattr(guards, "capturing", lambda operand=None: True)
    fo.gemm_all_reduce(a, b)
    monkeypatch.undo()
    monkeypatch.setattr(guards, "on_current_device", lambda operand: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # the CPU's "switch"
    fo.gemm_all_reduce(a, b)
    monkeypatch.undo()
    assert len(laned.calls) == calls + 2 and not laned.calls[-2].replay and laned.calls[-1].replay
    calls += 2
    for variable, value in (("FLASHOVERLAP_DEBUG_TIMEOUT", "5"), ("FLASHOVERLAP_REPLAY", "0"),
                            ("TORCH_DISTRIBUTED_DEBUG", "DETAIL")):
        monkeypatch.setenv(variable, value)
        settings.refresh()
        lanes = laned.lane_calls
        fo.gemm_all_reduce(a, b)
        assert laned.lane_calls == lanes and len(laned.calls) == calls + 1, variable
        calls += 1
        monkeypatch.delenv(variable)
    settings.refresh()
    assert fo.gemm_all_reduce(a, b)[0] == "lane"
    # A lane whose graph is gone: the call runs, and its replayer is built again.
    laned.graph, built = False, len(laned.built)
    torch.testing.assert_close(fo.gemm_all_reduce(a, b), a @ b)
    assert len(laned.calls) == calls + 1 and len(laned.built) == built + 1
    laned.graph = True
    assert fo.gemm_all_reduce(a, b)[0] == "lane"
    # the same memory read another way: a square operand and its transpose (one address, one shape)
    x, w = torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    fo.gemm_all_reduce(x, w)
    assert fo.gemm_all_reduce(x, w)[0] == "lane"
    calls = len(laned.calls)
    torch.testing.assert_close(fo.gemm_all_reduce(x.t(), w), x.t() @ w)
    assert len(laned.calls) == calls + 1
    def failing(spec):
        raise RuntimeError("NCCL error: unhandled cuda error")

    for key in list(context_module.REGISTRY.lanes):  # a backend's error in the lane is named as the run's are
        context_module.REGISTRY.lanes[key] = failing
    with pytest.raises(RuntimeError, match="^gemm_all_reduce on group .*unhandled cuda error"):
        fo.gemm_all_reduce(a, b)
    assert context_module.REGISTRY.lanes
    fo.release()
    assert not context_module.REGISTRY.lanes and not context_module.REGISTRY.resolved


def test_fp8_lanes_name_the_scales_and_the_bias(world_of_one, monkeypatch):
    """An fp8 call's lane key holds where its scales and bias lie: another scale tensor, output dtype or bias runs
    the call."""
    laned = _laned(world_of_one, ("gemm", "reference"), Laned, monkeypatch)
    a = torch.randn(8, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    sa, sb, bias = torch.rand(8, 1) + 0.5, torch.rand(1, 16) + 0.5, torch.randn(16, dtype=torch.bfloat16)
    fo.scaled_gemm_all_reduce(a, b, sa, sb, bias=bias)
    assert fo.scaled_gemm_all_reduce(a, b, sa, sb, bias=bias)[0] == "lane"
    calls = len(laned.calls)
    for other in (lambda: fo.scaled_gemm_all_reduce(a, b, sa.clone(), sb, bias=bias),
                  lambda: fo.scaled_gemm_all_reduce(a, b, sa, sb.clone(), bias=bias),
                  lambda: fo.scaled_gemm_all_reduce(a, b, sa, sb, bias=bias.clone()),
                  lambda: fo.scaled_gemm_all_reduce(a, b, sa, sb),
                  lambda: fo.scaled_gemm_all_reduce(a, b, sa, sb, bias=bias.float(), out_dtype=torch.float32)):
        other()
        assert len(laned.calls) == calls + 1
        calls += 1


class LanedExperts(Recording):
    """An expert communicator whose bounded-mode calls take the replay lane: ``run`` answers zeros of the result's
    shape; the replayer answers ``("lane", n)`` and records the spec it was given."""

    def __init__(self, group):
        super().__init__(group)
        self.built, self.specs = [], []

    def run(self, call):
        self.calls.append(call)
        rows = call.layout.recv_rows if call.plan.op == "dispatch" else call.plan.tokens
        return torch.zeros(rows, call.b.shape[2], dtype=call.a.dtype), None

    def replayer(self, call):
        if not call.replay:
            return None
        self.built.append(call)

        def again(spec):
            self.specs.append(spec)
            return ("lane", len(self.specs)), None

        return again


def test_a_bounded_expert_call_on_the_tensors_of_a_replayed_one_takes_the_lane(world_of_one, monkeypatch):
    """The expert ops' replay lane (``ExpertKind.lane_key``): a bounded-mode dispatch or combine reading the same
    rows, weights, layout, router weights, ``out`` and scales as one its communicator replayed is its replayer's
    answer alone, which is handed the new call's spec; exact mode, another layout (the same routing rebuilt), other
    rows, router weights, ``out``, path or scales, and debug mode run the call."""
    laned = _laned(world_of_one, ("expert", "reference"), LanedExperts, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    tokens, experts, top_k, hidden, ffn = 6, 4, 2, 8, 16
    idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    bounded = fo.moe_layout(idx, experts, mode="bounded")
    rebuilt = fo.moe_layout(idx, experts, mode="bounded")  # the same routing, other tensors
    exact = fo.moe_layout(idx, experts)
    x = torch.randn(tokens, hidden, generator=gen)
    w_up = torch.randn(experts, hidden, 2 * ffn, generator=gen)
    w_down = torch.randn(experts, ffn, hidden, generator=gen)
    act = torch.randn(bounded.recv_rows, ffn, generator=gen)
    out = torch.empty(tokens, hidden)

    def dispatch(rows=x, layout=bounded, **kw):
        return fo.moe_dispatch_gemm(rows, w_up, layout, **kw)

    def combine(rows=act, router=weights, layout=bounded, **kw):
        return fo.moe_gemm_combine(rows, w_down, router, layout, **kw)

    for first in (dispatch, combine, lambda: combine(out=out)):
        first()  # run: its replayer kept
        calls = len(laned.calls)
        assert first() [0] == "lane" and len(laned.calls) == calls  # the lane alone
    assert laned.specs[-1].out is out and laned.specs[-2].topk_weights is weights  # the new call's spec, given
    assert all(call.layout.mode == "bounded" for call in laned.built)
    others = [
        lambda: dispatch(layout=exact), lambda: dispatch(layout=exact),  # exact mode: never a lane
        lambda: dispatch(rows=x.clone()),  # other rows
        lambda: dispatch(layout=rebuilt),  # another layout
        lambda: combine(router=weights.clone()),  # other router weights
        lambda: combine(out=torch.empty(tokens, hidden)),  # another out
        lambda: fo.moe_gemm_combine(act, w_down, weights, bounded, path="reference"),  # another path
    ]
    for i, other in enumerate(others):
        lanes, calls = len(laned.specs), len(laned.calls)
        other()
        assert len(laned.specs) == lanes and len(laned.calls) == calls + 1, i
    assert fo.moe_gemm_combine(act, w_down, weights, bounded, path="reference") [0] == "lane"  # now its own lane
    # fp8 weights: the scales are part of the key
    w8, scale_w = w_up.to(torch.float8_e4m3fn), torch.rand(experts, 2 * ffn, generator=gen) + 0.5
    fo.moe_dispatch_gemm(x, w8, bounded, scale_w=scale_w)
    assert fo.moe_dispatch_gemm(x, w8, bounded, scale_w=scale_w) [0] == "lane"
    calls = len(laned.calls)
    fo.moe_dispatch_gemm(x, w8, bounded, scale_w=scale_w.clone())
    assert len(laned.calls) == calls + 1
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # debug mode: every call checked and run
    settings.refresh()
    calls = len(laned.calls)
    dispatch()
    assert len(laned.calls) == calls + 1
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    settings.refresh()
    assert dispatch() [0] == "lane"


def test_a_given_tile_that_cannot_fit_the_gpus_shared_memory_for_the_operands_is_refused(world_of_one, monkeypatch):
    # An fp8 tile (one-byte operands) given to a bf16 call failed inside Triton's launcher ("out of resource: shared
    # memory, Required: 294936, Hardware limit: 232448", tests/gpu/test_gpu_given_plans.py on an H100): the call
    # names the plan and the fix before anything runs. Off the GPU no limit is checked.
    from flashoverlap.plan import TileConfig
    from flashoverlap.tune.defaults import default_plan

    nccl = _install(world_of_one, ("gemm", "nccl"))
    monkeypatch.setattr(policy, "reason_not", lambda path, request: None)  # the NCCL path, on a CPU group
    fp8_tile = TileConfig(128, 256, 128, 8, 3, 8)
    plan = default_plan("all_reduce", 256, 256, 512, 1, tile=fp8_tile, num_groups=2, allow_sequential=False)
    bf16 = torch.randn(256, 512).bfloat16(), torch.randn(512, 256).bfloat16()
    other = default_plan("all_reduce", 512, 256, 512, 1, tile=fp8_tile, num_groups=2, allow_sequential=False)
    fo.gemm_all_reduce(torch.randn(512, 512).bfloat16(), bf16[1], path="nccl", plan=other)  # the CPU: no limit
    monkeypatch.setattr(guards, "shared_memory", lambda device: 232448)  # an H100's or H200's
    with pytest.raises(ValueError, match=r"gemm_all_reduce: the plan's tile .* needs about 294912 bytes of shared "
                                         r"memory a program with torch.bfloat16 operands, and this GPU gives a "
                                         r"program 232448"):
        fo.gemm_all_reduce(*bf16, path="nccl", plan=plan)
    fp8 = torch.randn(256, 512).to(torch.float8_e4m3fn), torch.randn(256, 512).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    fo.scaled_gemm_all_reduce(*fp8, one, one, path="nccl", plan=plan)  # the same tile with one-byte operands fits
    bf16_plan = default_plan("all_reduce", 256, 256, 512, 1, num_groups=2, allow_sequential=False)
    fo.gemm_all_reduce(*bf16, path="nccl", plan=bf16_plan)
    assert len(nccl.calls) == 3  # every call but the refused one
    # No plan given, on a GPU with less shared memory (an L4's): the message says the default's tile does not fit.
    from flashoverlap.runtime import plans as plans_module

    overlapped = default_plan("all_reduce", 128, 256, 512, 1, num_groups=2, allow_sequential=False)
    monkeypatch.setattr(plans_module, "path_and_plan", lambda *args: ("nccl", overlapped))  # a one-rank default is
    monkeypatch.setattr(guards, "shared_memory", lambda device: 101376)  # sequential: an overlapped one stood in
    with pytest.raises(ValueError, match=r"gemm_all_reduce: the default plan's tile .* this GPU has less shared "
                                         r"memory than the Hopper GPUs the defaults are made for"):
        fo.gemm_all_reduce(torch.randn(128, 512).bfloat16(), bf16[1], path="nccl")
