"""Bad input gets a clear exception naming the argument, raised before anything is launched."""

import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo


@pytest.fixture
def world_of_one():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _ab(m=8, n=6, k=4, dtype=torch.float16):
    return torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)


def test_needs_initialised_distributed():
    a, b = _ab()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fo.gemm_all_reduce(a, b)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: (torch.randn(2, 3, 4, dtype=torch.float16), torch.randn(4, 5, dtype=torch.float16)), ValueError,
         "a must be 2-D"),
        (lambda: (torch.randn(3, 4, dtype=torch.float16), torch.randn(4, dtype=torch.float16)), ValueError,
         "b must be 2-D"),
        (lambda: (torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)), ValueError,
         "a must be bfloat16, float16 or float32"),
        (lambda: (torch.randn(3, 4, dtype=torch.float16), torch.randn(4, 5, dtype=torch.bfloat16)), ValueError,
         "same dtype"),
        (lambda: (torch.randn(3, 4, dtype=torch.float16), torch.randn(5, 5, dtype=torch.float16)), ValueError,
         "K differ"),
        (lambda: (torch.randn(0, 4, dtype=torch.float16), torch.randn(4, 5, dtype=torch.float16)), ValueError,
         ">= 1"),
        (lambda: (torch.randn(3, 4, dtype=torch.float16), torch.randn(4, 5, dtype=torch.float16, device="meta")),
         ValueError, "same device"),
        (lambda: ([[1.0]], torch.randn(4, 5, dtype=torch.float16)), TypeError, "a must be a torch.Tensor"),
    ],
)
def test_operand_errors(world_of_one, make, exc, match):
    a, b = make()
    with pytest.raises(exc, match=match):
        fo.gemm_all_reduce(a, b)


def test_a_plan_cannot_be_combined_with_autograd(world_of_one):
    a, b = _ab()
    a.requires_grad_(True)
    plan = fo.default_plan("all_reduce", 8, 6, 4, 1)
    with pytest.raises(ValueError, match="plan= cannot be combined with autograd"):
        fo.gemm_all_reduce(a, b, plan=plan)


def test_no_grad_inputs_that_require_grad_are_fine(world_of_one):
    a, b = _ab()
    a.requires_grad_(True)
    with torch.no_grad():
        got = fo.gemm_all_reduce(a, b)
    torch.testing.assert_close(got, torch.matmul(a.detach(), b))


def test_path_and_group_errors(world_of_one):
    a, b = _ab()
    with pytest.raises(ValueError, match="path must be one of"):
        fo.gemm_all_reduce(a, b, path="fast")
    with pytest.raises(ValueError, match="path='nccl' needs CUDA"):
        fo.gemm_all_reduce(a, b, path="nccl")
    with pytest.raises(ValueError, match="path='p2p' needs CUDA"):
        fo.gemm_all_reduce(a, b, path="p2p")
    with pytest.raises(ValueError, match="path='p2p' needs CUDA"):
        fo.all_gather_gemm(a, b, path="p2p")
    p2p_plan = fo.default_plan("all_gather", 8, 6, 4, 1, path="p2p")
    with pytest.raises(ValueError, match="plan given is for path 'p2p'"):
        fo.all_gather_gemm(a, b, plan=p2p_plan, path="nccl")
    with pytest.raises(TypeError, match="plan must be a flashoverlap.Plan"):
        fo.all_gather_gemm(a, b, plan="fast")
    # On the CPU, "auto" runs the reference whatever the plan's path.
    torch.testing.assert_close(fo.all_gather_gemm(a, b, plan=p2p_plan), a @ b)
    with pytest.raises(TypeError, match="group must be"):
        fo.gemm_all_reduce(a, b, group="world")


def test_plan_errors(world_of_one):
    a, b = _ab()
    with pytest.raises(ValueError, match="plan is for"):
        fo.gemm_all_reduce(a, b, plan=fo.default_plan("all_reduce", 9, 6, 4, 1))
    with pytest.raises(ValueError, match="over 2 ranks"):
        fo.gemm_all_reduce(a, b, plan=fo.default_plan("all_reduce", 8, 6, 4, 2))
    with pytest.raises(TypeError, match="plan must be"):
        fo.gemm_all_reduce(a, b, plan="default")


def test_world_of_one_matches_matmul(world_of_one):
    a, b = _ab(33, 17, 9)
    torch.testing.assert_close(fo.gemm_all_reduce(a, b), torch.matmul(a, b))


def test_package_imports_and_runs_without_cuda_bindings():
    # The NCCL path imports cuda.bindings on first use only: a CPU user never needs it.
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None\n"
        "import flashoverlap, flashoverlap.comm.tp.nccl\n"
        "from flashoverlap.tune.defaults import default_plan\n"
        "print(default_plan('all_reduce', 64, 64, 64, 2).num_groups)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "1"


def _disagree(rank, world_size, what, done):
    import os

    import pytest

    from flashoverlap.testing import plain

    os.environ["FLASHOVERLAP_DEBUG_TIMEOUT"] = "5"
    dtype = torch.float16 if (what == "dtype" and rank == 1) else torch.bfloat16
    m = 8 + (2 if what == "shape" and rank == 1 else 0)
    a, b = torch.randn(m, 4, dtype=dtype), torch.randn(4, 6, dtype=dtype)
    if what == "skip":
        from tests.absent_rank import gave_up, stay_away

        if rank == 1:  # skips the call, and stays alive past rank 0's timeout (as a rank stuck elsewhere would)
            stay_away(done)
            return "skipped"
        try:
            with pytest.raises(RuntimeError, match=r"rank 0: gemm_all_reduce on group .*: rank 1 did not reach the "
                                                   r"call within 5 s"):
                fo.gemm_all_reduce(a, b)
        finally:
            gave_up(done)
        return "timed out"
    if what == "leaves":
        if rank == world_size - 1:  # leaves before the call, its connections closed (as a rank that raised or died)
            dist.destroy_process_group()
            return "left"
        with pytest.raises(RuntimeError, match=rf"rank {rank}: gemm_all_reduce on group .*: the agreement exchange "
                                               rf"failed: rank {world_size - 1} never reached it"):
            fo.gemm_all_reduce(a, b)
        return "named"
    if what in ("same plan", "plan"):  # a plan given: the same on both ranks, or another tiling on rank 1
        tile = fo.TileConfig(32 if what == "plan" and rank == 1 else 64, 64, 32, 8, 3, 4)
        plan = fo.default_plan("all_reduce", m, 6, 4, world_size, tile=tile, allow_sequential=False)
        if what == "same plan":
            torch.testing.assert_close(fo.gemm_all_reduce(a, b, plan=plan), plain("all_reduce", a, b))
            return "agreed"
        with pytest.raises(ValueError, match="disagree on plan"):
            fo.gemm_all_reduce(a, b, plan=plan)
        return "refused"
    with pytest.raises(ValueError, match="disagree on " + ("dtype of a and b" if what == "dtype" else "a's rows M")):
        fo.gemm_all_reduce(a, b)
    return "refused"


@pytest.mark.parametrize("what", ["dtype", "shape", "skip", "leaves", "plan", "same plan"])
def test_debug_mode_catches_ranks_that_disagree_or_never_come(what, tmp_path):
    from flashoverlap.testing import spawn

    # A plan is compared by a digest: in fresh interpreters each rank has its own string-hash salt, as on separate
    # machines, so that a digest that depends on it cannot agree by a salt forked ranks would share.
    world = 3 if what == "leaves" else 2
    results = spawn(_disagree, world, args=(what, str(tmp_path / "done")), fresh=what in ("plan", "same plan"))
    expected = {"skip": ["timed out", "skipped"], "same plan": ["agreed", "agreed"],
                "leaves": ["named", "named", "left"]}
    assert results == expected.get(what, ["refused", "refused"])  # the survivors name the rank that left


def test_float32_runs_any_plan_on_the_reference_path_but_no_overlapped_one_on_cuda(world_of_one):
    a, b = _ab(dtype=torch.float32)
    plan = fo.default_plan("all_reduce", 8, 6, 4, 1, allow_sequential=False)
    torch.testing.assert_close(fo.gemm_all_reduce(a, b, plan=plan), a @ b)  # the CPU: the reference path
    with pytest.raises(ValueError, match="path='nccl' needs CUDA tensors"):
        fo.gemm_all_reduce(a, b, plan=plan, path="nccl")
    # On CUDA the rule is the policy's (tests/runtime/test_policy.py): float32 runs only sequential plans there.


def _outside_the_group(rank, world):
    """Rank 2 is outside ``new_group([0, 1])`` and passes what ``new_group`` returned there; ranks 0 and 1 use the
    group. ``moe_layout``'s num_experts as a 0-d integer tensor is the int it holds."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    if rank == 2:
        for call in (lambda: fo.gemm_all_reduce(a, b, group),
                     lambda: fo.moe_layout(torch.zeros(3, 1, dtype=torch.long), 2, group)):
            with pytest.raises(ValueError, match=r"this rank \(global 2\) is not a member of group \(dist.new_group"):
                call()
        return "refused"
    layout = fo.moe_layout(torch.zeros(3, 1, dtype=torch.long), torch.tensor(2), group)
    assert layout.experts == 2 and isinstance(layout.experts, int)
    with pytest.raises(TypeError, match="num_experts must be an int, got float 2.0"):
        fo.moe_layout(torch.zeros(3, 1, dtype=torch.long), 2.0, group)
    return tuple(fo.gemm_all_reduce(a, b, group).shape)


def test_a_rank_outside_the_group_is_told_so_and_num_experts_takes_any_integer():
    from flashoverlap.testing import spawn

    assert spawn(_outside_the_group, 3) == [(4, 6), (4, 6), "refused"]


def test_fp8_scales_that_are_not_tensors_are_named_before_the_signature(world_of_one):
    """On one rank the call's first-call agreement comes after its signature (no rank to agree with, as on the GPU
    paths' repeated calls): a Python number or None as a scale must still be named, not met by an AttributeError
    of the signature."""
    a = torch.randn(4, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    for scale_a, scale_b, said in ((1.0, torch.ones(()), "scale_a must be a torch.Tensor, got float"),
                                   (None, torch.ones(()), "scale_a must be a torch.Tensor, got NoneType"),
                                   (torch.ones(()), 2, "scale_b must be a torch.Tensor, got int")):
        with pytest.raises(TypeError, match=said):
            fo.scaled_gemm_all_reduce(a, b, scale_a, scale_b)


def test_a_repeated_fp8_call_whose_scale_moved_to_another_device_is_refused(world_of_one):
    """A call that repeats a cached one (one rank: no agreement, the signature alone decides, as on the GPU paths)
    but with a scale on another device must meet the device check, not the first call's cached resolution."""
    a = torch.randn(4, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    scale_a, scale_b = torch.ones(4, 1), torch.ones(1, 16)
    for _ in range(2):
        fo.scaled_gemm_all_reduce(a, b, scale_a, scale_b)
    with pytest.raises(ValueError, match="scale_a is on meta but a is on cpu"):
        fo.scaled_gemm_all_reduce(a, b, scale_a.to("meta"), scale_b)
    with pytest.raises(ValueError, match="scale_b is on meta but a is on cpu"):
        fo.scaled_gemm_all_reduce(a, b, scale_a, scale_b.to("meta"))


def test_sparse_operands_are_named_before_anything_runs(world_of_one):
    """A sparse (or other non-strided) operand, scale or bias is refused by name: it has no strides for the kernels,
    the copies or the collectives (before, a torch error from deep inside the call, naming neither)."""
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    ones_a, ones_b = torch.ones(4, 1), torch.ones(1, 6)
    layout = fo.moe_layout(torch.zeros(4, 1, dtype=torch.long), 2)
    cases = [
        ("gemm_all_reduce: a", lambda: fo.gemm_all_reduce(a.to_sparse(), b)),
        ("gemm_reduce_scatter: b", lambda: fo.gemm_reduce_scatter(a, b.to_sparse_csr())),
        ("all_gather_gemm: a_shard", lambda: fo.all_gather_gemm(a.to_sparse(), b)),
        ("all_gather_scaled_gemm: scale_a_shard", lambda: fo.all_gather_scaled_gemm(a8, b8, ones_a.to_sparse(),
                                                                                    ones_b)),
        ("scaled_gemm_all_reduce: scale_a", lambda: fo.scaled_gemm_all_reduce(a8, b8, ones_a.to_sparse(), ones_b)),
        ("scaled_gemm_all_reduce: bias", lambda: fo.scaled_gemm_all_reduce(
            a8, b8, ones_a, ones_b, bias=torch.ones(6, dtype=torch.bfloat16).to_sparse())),
        ("moe_layout: topk_idx", lambda: fo.moe_layout(torch.zeros(4, 1, dtype=torch.long).to_sparse(), 2)),
        ("moe_dispatch_gemm: x", lambda: fo.moe_dispatch_gemm(a.to_sparse(), torch.randn(2, 8, 6), layout)),
    ]
    for said, call in cases:
        with pytest.raises(ValueError, match=f"{said} must be a dense tensor, got layout torch.sparse_"):
            call()


def test_a_device_mesh_or_a_group_name_is_refused_alike_with_and_without_autograd(world_of_one):
    """``group`` is checked the same whether the call goes through the custom op (an input requires grad: it
    took a group's name, and a DeviceMesh met an AttributeError) or not; ``release`` refuses what it could not
    match (a DeviceMesh released nothing, silently)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    for group, said in ((mesh, r"got DeviceMesh \(a DeviceMesh: pass mesh.get_group\(\)\)"),
                        (mesh.get_group().group_name, "got str")):
        for grad in (False, True):
            a = torch.randn(4, 3, requires_grad=grad)
            with pytest.raises(TypeError, match=f"gemm_all_reduce: group must be a torch.distributed ProcessGroup "
                                                f"or None, {said}"):
                fo.gemm_all_reduce(a, torch.randn(3, 5), group)
        with pytest.raises(TypeError, match=f"release: group must be a torch.distributed ProcessGroup or None, {said}"):
            fo.release(group)
    fo.release(mesh.get_group())  # the mesh's group itself: released


def test_the_all_gathers_errors_name_their_own_arguments(world_of_one):
    """The all-gathers take ``a_shard`` (and ``scale_a_shard``): their errors said ``a`` and ``scale_a``, arguments
    they do not have."""
    a8 = torch.randn(8, 256).to(torch.float8_e4m3fn)
    b8 = torch.randn(256, 32).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"all_gather_scaled_gemm: scale_a_shard \[16, 1\] and scale_b \[1, 32\] "
                                         r"fit no scaling mode for a_shard \[8, 256\]"):
        fo.all_gather_scaled_gemm(a8, b8, torch.ones(16, 1), torch.ones(1, 32))
    with pytest.raises(ValueError, match=r"all_gather_scaled_gemm: scale_a_shard must be float32"):
        fo.all_gather_scaled_gemm(a8, b8, torch.ones(8, 1, dtype=torch.float64), torch.ones(1, 32))
    with pytest.raises(ValueError, match=r"all_gather_gemm: a_shard is \[M, K\] = \[8, 256\] and b is \[K, N\]"):
        fo.all_gather_gemm(torch.randn(8, 256), torch.randn(128, 32))
