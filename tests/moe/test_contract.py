"""The expert call contract without ranks: ``ExpertPlan`` validation and shape algebra, the grouped-GEMM choice
(never the loop in bounded mode), the expert path rules (``policy.expert_path``), ``expert_layout`` on a world of
one (send order, rows, segments, both modes, the bound check) and the weighted sum at the origin into a given
``out``, in this process."""

import tempfile

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.comm.expert import BoundExceeded, ExpertPlan, expert_layout
from flashoverlap.comm.expert.chunked_gemm import chunk_gemm
from flashoverlap.comm.expert.rows import combine_at_origin, recv_segments, send_buffer
from flashoverlap.comm.protocol import CommGroup
from flashoverlap.runtime import experts as runtime_experts
from flashoverlap.runtime import policy


def test_plan_is_validated_hashable_and_states_its_shapes():
    plan = ExpertPlan("dispatch", 4, 16, 64, 96, 2, 10, "bounded", 20)
    assert plan == ExpertPlan("dispatch", 4, 16, 64, 96, 2, 10, "bounded", 20) and hash(plan) == hash(
        ExpertPlan("dispatch", 4, 16, 64, 96, 2, 10, "bounded", 20))
    assert plan.experts_per_rank == 4 and plan.gemm_shape == (64, 96) and plan.send_capacity == 80
    assert plan.recv_capacity == 80 and plan.choices == 20
    combine = ExpertPlan("combine", 4, 16, 64, 96, 2, 10)
    assert combine.gemm_shape == (96, 64) and combine.send_capacity == 20 and combine.recv_capacity is None
    for bad, match in [(dict(op="scatter"), "op must be"), (dict(experts=6), "cannot be shared evenly"),
                       (dict(mode="bounded"), "needs bound"), (dict(bound=3), "takes no bound"),
                       (dict(top_k=17), "exceeds"), (dict(hidden=0), "hidden must be"), (dict(gemm="x"), "gemm"),
                       (dict(weighted=False), "combine only"), (dict(tokens=-1), "tokens")]:
        args = dict(op="dispatch", world_size=4, experts=16, hidden=64, ffn=96, top_k=2, tokens=10) | bad
        with pytest.raises(ValueError, match=match):
            ExpertPlan(**args)


def test_the_gemm_default_is_the_runtimes_choice_and_never_a_loop_in_bounded_mode(monkeypatch):
    assert ExpertPlan("dispatch", 2, 4, 8, 8, 1, 3, "bounded", 3).gemm is None
    assert ExpertPlan("dispatch", 2, 4, 8, 8, 1, 3, gemm="loop").gemm == "loop"  # exact mode: host sizes
    with pytest.raises(ValueError, match=r"gemm='loop' cannot run with mode='bounded'.*gemm='triton' or 'cublas'"):
        ExpertPlan("dispatch", 2, 4, 8, 8, 1, 3, "bounded", 3, "loop")
    # A plan without a choice (built outside the runtime), on CUDA: the loop where sizes are on the host, else Triton.
    cuda = torch.device("cuda")  # chunk_gemm reads only the device's type
    assert chunk_gemm(ExpertPlan("combine", 2, 4, 8, 8, 1, 3), torch.bfloat16, cuda) == "loop"
    assert chunk_gemm(ExpertPlan("combine", 2, 4, 8, 8, 1, 3, "bounded", 3), torch.bfloat16, cuda) == "triton"
    # The runtime's choice: the measured policy (fp32: Triton), and where Triton is missing the loop (exact) or
    # cuBLAS's grouped GEMM (bounded): never the loop in bounded mode.
    for available, exact, bounded in ((True, "triton", "triton"), (False, "loop", "cublas")):
        monkeypatch.setattr(runtime_experts, "_triton_available", lambda available=available: available)
        assert runtime_experts.choose_gemm("exact", 4, 64, 32, 32, torch.float32, None) == exact
        assert runtime_experts.choose_gemm("bounded", 4, 64, 32, 32, torch.float32, None) == bounded
        for dtype in (torch.bfloat16, torch.float16):
            for rows, k in ((64, 32), (1 << 16, 4096)):
                assert runtime_experts.choose_gemm("bounded", 4, rows, k, k, dtype, (9, 0)) in ("triton", "cublas")


def _request(device="cuda", dtype=torch.bfloat16, world=2, available=("reference", "nccl", "p2p"), p2p=None,
             disabled=False):
    asked = []

    def p2p_reason():
        asked.append(True)
        return p2p

    request = policy.ExpertRequest(torch.device(device), dtype, world, frozenset(available), p2p_reason, disabled)
    return request, asked


def test_auto_takes_p2p_then_nccl_then_the_reference():
    assert policy.expert_path("op", "auto", _request()[0])[0] == "p2p"
    assert policy.expert_path("op", "auto", _request(p2p="no peer access")[0])[0] == "nccl"
    assert policy.expert_path("op", "auto", _request(disabled=True)[0]) == ("nccl", "NCCL_P2P_DISABLE=1 is set")
    assert policy.expert_path("op", "auto", _request(dtype=torch.float32)[0])[0] == "nccl"
    assert policy.expert_path("op", "auto", _request(world=16)[0])[0] == "nccl"
    assert policy.expert_path("op", "auto", _request(available=("reference",))[0])[0] == "reference"
    request, asked = _request(device="cpu")
    assert policy.expert_path("op", "auto", request)[0] == "reference" and not asked  # no collective off CUDA
    request, asked = _request(available=("reference", "nccl"))
    assert policy.expert_path("op", "auto", request)[0] == "nccl" and not asked  # nor for a path not installed


def test_a_named_path_that_cannot_apply_says_why():
    with pytest.raises(ValueError, match="op: path='p2p' cannot apply to this group: no peer access"):
        policy.expert_path("op", "p2p", _request(p2p="no peer access")[0])
    with pytest.raises(ValueError, match="no expert communicator for path='nccl'"):
        policy.expert_path("op", "nccl", _request(available=("reference",))[0])
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        policy.expert_path("op", "nccl", _request(device="cpu")[0])
    with pytest.raises(ValueError, match="path must be one of"):
        policy.expert_path("op", "ring", _request()[0])
    assert policy.expert_path("op", "reference", _request()[0])[0] == "reference"


@pytest.fixture
def world_of_one():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            yield CommGroup.of(dist.group.WORLD, torch.device("cpu"))
        finally:
            fo.release()
            dist.destroy_process_group()


def test_layout_on_one_rank(world_of_one):
    idx = torch.tensor([[3, 1], [0, 3], [2, 1]])
    weights = torch.rand(3, 2)
    exact = expert_layout(idx, 4, world_of_one, topk_weights=weights)
    # Choices t * k + c sorted stably by expert: expert 0: (1, 0); 1: (0, 1), (2, 1); 2: (2, 0); 3: (0, 0), (1, 1).
    assert exact.send_order.tolist() == [2, 1, 5, 4, 0, 3] and exact.send_rows.tolist() == list(range(6))
    assert exact.send_counts.tolist() == [[1, 2, 1, 2]] == exact.recv_counts.tolist()
    # Experts that get no token, first, between and last: counted zero.
    sparse = expert_layout(torch.tensor([[4, 1], [4, 2], [1, 4]]), 6, world_of_one, mode="bounded", bound=6)
    assert sparse.send_counts.tolist() == [[0, 2, 1, 0, 3, 0]] == sparse.recv_counts.tolist()
    assert exact.send_splits == (6,) == exact.recv_splits and exact.recv_rows == 6 and exact.max_pair_rows == 6
    # The received counts come to the host with the splits (the one synchronisation); bounded mode reads none.
    assert exact.recv_counts_host == ((1, 2, 1, 2),) and exact.rows_per_expert == (1, 2, 1, 2)
    assert exact.with_weights(None).recv_counts_host == exact.recv_counts_host
    assert sparse.recv_counts_host is None and sparse.rows_per_expert is None
    assert torch.equal(exact.weights, weights.reshape(-1)[exact.send_order])
    starts, ends, local = recv_segments(exact)
    assert starts.tolist() == [0, 1, 3, 4] and ends.tolist() == [1, 3, 4, 6] and local.tolist() == [0, 1, 2, 3]
    bounded = expert_layout(idx, 4, world_of_one, mode="bounded", bound=8)
    assert bounded.send_splits is None and bounded.recv_rows == 8 and bounded.send_capacity == 8
    assert bounded.max_pair_rows == 8  # the bound
    plan = ExpertPlan("dispatch", 1, 4, 5, 7, 2, 3, "bounded", 8)
    x = torch.randn(3, 5)
    buffer = send_buffer(x, plan, bounded)
    assert torch.equal(buffer[:6], x[bounded.send_order // 2]) and not buffer[6:].any()  # padding zero
    with pytest.raises(BoundExceeded, match=r"bound=5 .*rank 0 -> rank 0: 6.*pass bound >= 6"):
        expert_layout(idx, 4, world_of_one, mode="bounded", bound=5)
    with pytest.raises(ValueError, match=r"num_experts must be >= 1, got 0"):
        expert_layout(torch.zeros((0, 2), dtype=torch.int64), 0, world_of_one)
    with pytest.raises(ValueError, match=r"rank\(s\) \[0\] .* outside \[0, 4\) \(1 in all\)"):
        expert_layout(torch.tensor([[0, 4]]), 4, world_of_one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_combine_at_origin_writes_into_a_given_out(world_of_one, dtype):
    idx = torch.tensor([[3, 1], [0, 3], [2, 1], [1, 2], [0, 2]])
    layout = expert_layout(idx, 4, world_of_one, topk_weights=torch.rand(5, 2))
    plan = ExpertPlan("combine", 1, 4, 7, 3, 2, 5)
    back = torch.randn(layout.send_capacity, 7).to(dtype)
    want = combine_at_origin(back, plan, layout, dtype)
    out = torch.full((5, 7), float("nan"), dtype=dtype)
    got = combine_at_origin(back, plan, layout, dtype, out=out)
    assert got is out and torch.equal(out, want)  # every row written, bit for bit the allocating result
    tokens = torch.div(layout.send_order, 2, rounding_mode="floor")
    plain = torch.zeros(5, 7).index_add_(0, tokens, back.float() * layout.weights[:, None])
    torch.testing.assert_close(out.float(), plain, atol=1e-2 if dtype != torch.float32 else 1e-6, rtol=1e-2)
    for bad, match in ((torch.empty(4, 7, dtype=dtype), r"\[5, 7\] .* got \[4, 7\]"),
                       (torch.empty(5, 7, dtype=torch.float64), "got .*torch.float64"),
                       (torch.empty(5, 7, dtype=dtype, device="meta"), "got .* on meta")):
        with pytest.raises(ValueError, match=f"combine_at_origin: out must be .*{match}"):
            combine_at_origin(back, plan, layout, dtype, out=bad)
    with pytest.raises(TypeError, match="combine_at_origin: out must be a torch.Tensor"):
        combine_at_origin(back, plan, layout, dtype, out=[0.0])


def test_an_exact_layout_s_counts_choose_its_grouped_gemm():
    """The plan's first call guesses balanced rows; a call whose exact-mode layout carries its counts on the host takes
    the cost model's choice for those counts (``tune.grouped.expert_gemm`` on ``Layout.rows_per_expert``)."""
    from types import SimpleNamespace

    from flashoverlap import settings
    from flashoverlap.comm.expert import ExpertPlan
    from flashoverlap.runtime import experts as runtime_experts
    from flashoverlap.tune import grouped

    local, k, n = 16, 4096, 2816
    plan = ExpertPlan("dispatch", 2, 32, k, n // 2, 8, 4096, "exact", None, "cublas")
    skewed = (30000, *([16] * (local - 1)))  # one hot expert: Zipf-like routing
    want = grouped.expert_gemm(grouped.GroupedCall(skewed, k, n, 2, 2), torch.bfloat16, mode="exact",
                               device_capability=(9, 0), triton=runtime_experts._triton_available())
    spec = SimpleNamespace(name="t", op="dispatch", a=torch.empty(0, k, dtype=torch.bfloat16, device="meta"),
                           b=torch.empty(local, k, n, device="meta"), hook=None, return_gathered=False, out=None,
                           layout=SimpleNamespace(rows_per_expert=skewed, mode="exact"), scales=None)
    runtime_experts._gemm_for_rows.cache_clear()
    original = torch.cuda.get_device_capability
    try:
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        spec.a, spec.b = spec.a, spec.b
        call = runtime_experts.EXPERT.call(spec, (None, plan, False), settings.read({}))
    finally:
        torch.cuda.get_device_capability = original
        runtime_experts._gemm_for_rows.cache_clear()
    assert call.plan.gemm == want[0] and call.plan.hybrid == want[1]
    spec.layout = SimpleNamespace(rows_per_expert=None, mode="bounded")  # no counts on the host: the plan's own
    assert runtime_experts.EXPERT.call(spec, (None, plan, False), settings.read({})).plan is plan
