"""flashoverlap.nn.ColwiseParallel / RowwiseParallel under torch's ``parallelize_module`` on gloo ranks (reference
path), against PyTorch's own styles (same plan, same weights: outputs, input gradient, every parameter's gradient
and its placements, fp32 at 1e-5) and against the unsharded model (fp32, and bf16 at 2e-2): the four overlapped
cases (sequence-parallel colwise and rowwise at batch 1 and at an odd batch, replicated colwise and rowwise), a
torchtitan-style ``PrepareModuleInput``, DTensor outputs, a colwise output redistributed; which of the library's ops
ran, forward and backward; the cases left to PyTorch (uneven sequence, float64, layouts not overlapped) running
exactly as PyTorch's; compiled; and on a 2 x 2 mesh under FSDP2, one optimizer step equal to PyTorch's styles."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flashoverlap.testing import spawn

HIDDEN, INNER = 20, 36
LIMITS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Block(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.up = nn.Linear(HIDDEN, INNER, dtype=dtype)
        self.down = nn.Linear(INNER, HIDDEN, dtype=dtype)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    """A block inside a model, so that a ``PrepareModuleInput`` on the block runs inside the model's forward."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.block = Block(dtype)

    def forward(self, x):
        return self.block(x)


class _OpsSeen(TorchDispatchMode):
    """The library's ops that ran (forward and backward), by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "flashoverlap":
            self.names.append(func._schema.name.split("::")[1])
        return func(*args, **(kwargs or {}))


def _rel(got, want):
    got, want = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (got, want))
    got, want = got.detach(), want.detach()
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _plan(styles, case):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    col, row = styles.ColwiseParallel, styles.RowwiseParallel
    return {
        "sequence": {"block.up": col(input_layouts=Shard(1)), "block.down": row(output_layouts=Shard(1))},
        "replicate": {"block.up": col(), "block.down": row()},
        "titan": {"block": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                  "block.up": col(), "block.down": row(output_layouts=Shard(1))},
        "dtensor_out": {"block.up": col(input_layouts=Shard(1), use_local_output=False),
                        "block.down": row(output_layouts=Shard(1), use_local_output=False)},
        "gathered_out": {"block.up": col(input_layouts=Shard(1), output_layouts=Replicate())},
        "uneven": {"block.up": col(), "block.down": row(output_layouts=Shard(1))},
        "not_overlapped": {"block.up": col(input_layouts=Shard(-1), output_layouts=Replicate()),
                           "block.down": row(input_layouts=Replicate())},
    }[case]


# What each case's input is on rank r (a slice of the whole x), and what its output is of the whole output.
_SEQUENCE_IN = {"sequence", "titan", "dtensor_out", "gathered_out"}
_SEQUENCE_OUT = {"sequence", "titan", "dtensor_out", "uneven"}
_OPS = {
    "sequence": {"all_gather_gemm", "gemm_reduce_scatter", "all_gather_gemm_backward",
                 "gemm_reduce_scatter_backward"},
    "replicate": {"linear_column", "gemm_all_reduce", "linear_column_backward"},
    "titan": {"gemm_reduce_scatter", "gemm_reduce_scatter_backward"},  # up gets PrepareModuleInput's Replicate
    "dtensor_out": {"all_gather_gemm", "gemm_reduce_scatter", "all_gather_gemm_backward",
                    "gemm_reduce_scatter_backward"},
    "gathered_out": {"all_gather_gemm", "all_gather_gemm_backward"},
    "uneven": {"linear_column", "linear_column_backward"},  # the uneven reduce-scatter is PyTorch's
    "not_overlapped": set(),
}


def _rows(t, rank, world, dim):
    """Rank r's part of ``t`` along ``dim`` as DTensor shards it (uneven: the first ranks get one more)."""
    return t.tensor_split(world, dim=dim)[rank] if dim is not None else t


def _run(model, x_local, compiled=False):
    from torch.distributed.tensor import DTensor

    x_local = x_local.clone().requires_grad_(True)
    # Compiled: Inductor with ATen kernels (its C++ code generation costs a minute on two cores, and is the same
    # for either style); a dispatch mode cannot watch a compiled graph, so the ops are seen in eager runs only.
    seen = _OpsSeen()
    if compiled:
        torch._dynamo.reset()  # another case's compiled code must not be reused (and recompiling can recurse)
    run = torch.compile(model, fullgraph=True, options={"fallback_by_default": True}) if compiled else model
    with seen if not compiled else contextlib.nullcontext():
        y = run(x_local)
        y_local = y.to_local() if isinstance(y, DTensor) else y
        y_local.float().pow(2).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return y, x_local.grad, grads, set(seen.names)


def _case(rank, world, case, batch, seq, dtype, compiled=False):
    """One case: ours against PyTorch's styles and against the unsharded model. Returns the failures found."""
    import torch.distributed.tensor.parallel as torch_styles
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import flashoverlap.nn as fnn

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    full = Model(dtype)
    x = torch.randn(batch, seq, HIDDEN, dtype=dtype)
    if case == "not_overlapped":  # up's input sharded on the hidden dimension
        x_local = _rows(x, rank, world, 2)
    else:
        x_local = _rows(x, rank, world, 1 if case in _SEQUENCE_IN else None)
    x_full = x.clone().requires_grad_(True)
    full(x_full).float().pow(2).sum().backward()
    want_y = _rows(full(x).detach(), rank, world, 1 if case in _SEQUENCE_OUT else None)
    want_gx = _rows(x_full.grad, rank, world, 2 if case == "not_overlapped" else 1 if case in _SEQUENCE_IN else None)
    want_grads = {name: p.grad for name, p in full.named_parameters()}

    results = {}
    for name, styles in (("torch", torch_styles), ("ours", fnn)):
        model = parallelize_module(copy.deepcopy(full), mesh, _plan(styles, case))
        model.zero_grad()
        results[name] = _run(model, x_local, compiled and name == "ours")
        routed = {m for m in ("up", "down") if type(getattr(model.block, m)).__name__.startswith("FlashOverlap")}
        results[name + "_routed"] = routed
    failures = []
    (y, gx, grads, ops), (ty, tgx, tgrads, _) = results["ours"], results["torch"]
    if isinstance(ty, DTensor) != isinstance(y, DTensor) or (isinstance(y, DTensor) and y.placements != ty.placements):
        failures.append(f"output type/placements {type(y).__name__} vs PyTorch's {type(ty).__name__}")
    y = y.to_local() if isinstance(y, DTensor) else y
    ty = ty.to_local() if isinstance(ty, DTensor) else ty
    limit = LIMITS[dtype] if dtype in LIMITS else 1e-12
    checks = {"y": (y, ty, want_y), "x.grad": (gx, tgx, want_gx)}
    for pname, grad in grads.items():
        checks[pname] = (grad, tgrads[pname], want_grads[pname])
        if getattr(grad, "placements", None) != getattr(tgrads[pname], "placements", None):
            failures.append(f"{pname}.grad placements {grad.placements} vs PyTorch's {tgrads[pname].placements}")
    for what, (got, torch_got, want) in checks.items():
        if dtype == torch.float32 and not _rel(got, torch_got) < 1e-5:
            failures.append(f"{what}: {_rel(got, torch_got):.2e} from PyTorch's styles")
        if not _rel(got, want) < limit:
            failures.append(f"{what}: {_rel(got, want):.2e} from the unsharded model")
    expected = _OPS[case] if dtype in LIMITS else set()
    if not compiled and ops != expected:
        failures.append(f"ops {sorted(ops)}, expected {sorted(expected)}")
    if case == "not_overlapped" and results["ours_routed"]:
        failures.append(f"{results['ours_routed']} routed to flashoverlap for layouts it does not overlap")
    return failures


def _cases(rank, world_size, cases):
    return {f"{case} batch={b} seq={s} {str(d)[6:]}{' compiled' if c else ''}":
            _case(rank, world_size, case, b, s, d, c) for case, b, s, d, c in cases}


CASES = [
    ("sequence", 1, 10, torch.float32, False),
    ("sequence", 3, 10, torch.float32, False),  # B > 1: the shard moved sequence-major and back
    ("sequence", 1, 10, torch.bfloat16, False),
    ("replicate", 3, 7, torch.float32, False),
    ("replicate", 1, 8, torch.bfloat16, False),
    ("titan", 1, 10, torch.float32, False),
    ("titan", 2, 6, torch.bfloat16, False),
    ("dtensor_out", 2, 6, torch.float32, False),
    ("gathered_out", 1, 10, torch.float32, False),
    ("uneven", 1, 5, torch.float32, False),  # 5 tokens over 2 ranks: PyTorch's uneven reduce-scatter
    ("replicate", 1, 8, torch.float64, False),  # a dtype the ops do not take: PyTorch's path
    ("not_overlapped", 1, 8, torch.float32, False),
    ("sequence", 3, 10, torch.float32, True),
    ("titan", 1, 10, torch.float32, True),  # a DTensor input under compile
]


def test_styles_match_pytorchs_and_the_unsharded_model():
    results = spawn(_cases, 2, args=(CASES,))
    bad = {(rank, case): failures for rank, result in enumerate(results) for case, failures in result.items()
           if failures}
    assert not bad, bad


# -- FSDP2 on a 2-D mesh ---------------------------------------------------------------------------------------------
def _fsdp_step(rank, world_size):
    import torch.distributed.tensor.parallel as torch_styles
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import flashoverlap.nn as fnn

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"must be 1-D .* pass mesh\['tp'\]"):
        parallelize_module(Model(), mesh, {"block.up": fnn.ColwiseParallel()})
    torch.manual_seed(2)
    full = nn.Sequential(Model(), Model())
    x = torch.randn(2, 2, 8, HIDDEN)[mesh.get_local_rank("dp")]  # a batch of 2 per data-parallel rank
    tp_rank = mesh.get_local_rank("tp")
    out = {}
    for name, styles in (("torch", torch_styles), ("ours", fnn)):
        model = copy.deepcopy(full)
        for block in model:
            parallelize_module(block, mesh["tp"], _plan(styles, "sequence"))
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        y = model(x.tensor_split(2, dim=1)[tp_rank])
        loss = y.pow(2).mean()
        loss.backward()
        optim.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out[name] = (total, {n: p.full_tensor() for n, p in model.named_parameters()})
    failures = []
    if not _rel(out["ours"][0], out["torch"][0]) < 1e-6:
        failures.append(f"loss {out['ours'][0]} vs {out['torch'][0]}")
    for n, p in out["ours"][1].items():
        if not _rel(p, out["torch"][1][n]) < 1e-6:
            failures.append(f"{n}: {_rel(p, out['torch'][1][n]):.2e}")
    moved = [n for n, p in out["ours"][1].items() if torch.equal(p, full.get_parameter(n))]
    if moved:
        failures.append(f"not updated by the step: {moved}")
    return failures


def test_fsdp2_on_top_of_the_styles_steps_as_pytorchs_styles_do():
    results = spawn(_fsdp_step, 4)
    assert not any(results), results


def test_hf_plan_maps_onto_the_styles():
    from torch.distributed.tensor import Replicate, Shard

    import flashoverlap.nn as fnn

    plan = fnn.styles_from_hf_plan({"layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise",
                                    "lm_head": "colwise_rep"}, prefix="model.")
    assert set(plan) == {"model.layers.*.q_proj", "model.layers.*.o_proj", "model.lm_head"}
    assert isinstance(plan["model.layers.*.q_proj"], fnn.ColwiseParallel)
    assert plan["model.layers.*.o_proj"].output_layouts == (Replicate(),)
    assert plan["model.lm_head"].output_layouts == (Replicate(),)
    assert plan["model.layers.*.q_proj"].output_layouts == (Shard(-1),)
    with pytest.raises(ValueError, match=r"no flashoverlap style for 'packed_colwise'; mapped are"):
        fnn.styles_from_hf_plan({"experts.gate_up": "packed_colwise"})
    # values of mixed types (None beside a string; a list): each named, not a TypeError from sorting them
    with pytest.raises(ValueError, match=r"no flashoverlap style for 'packed_colwise', None, \['colwise'\];"):
        fnn.styles_from_hf_plan({"a": None, "b": "packed_colwise", "c": ["colwise"], "d": "colwise"})


def _replicated_norm(rank, world_size):
    """A replicated weight applied to this rank's part of a sharded axis: with ``ReplicatedWithGradAllReduce`` its
    gradient is the sum of every rank's (the unsharded model's), also over two accumulated backward passes (a sum of
    sums would count the first pass W times)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import flashoverlap.nn as fnn

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    xs = [torch.randn(world_size, 3, 5) for _ in range(2)]  # [ranks, tokens, features]: rank r sees xs[:, r]
    norm = torch.nn.LayerNorm(5)
    full = copy.deepcopy(norm)
    for x in xs:
        full(x.reshape(-1, 5)).pow(2).sum().backward()
    parallelize_module(norm, mesh, fnn.styles_from_hf_plan({"": "replicated_with_grad_allreduce"})[""])
    with torch.no_grad():  # hooks attach at a forward: the weight swapped out and back in gets no second hook
        norm(xs[0][rank])
        kept = norm.weight
        norm.weight = torch.nn.Parameter(kept.detach().clone())
        norm(xs[0][rank])
        norm.weight = kept
    for x in xs:
        norm(x[rank]).pow(2).sum().backward()
    return [float((norm.get_parameter(n).grad - p.grad).abs().max()) for n, p in full.named_parameters()]


def test_replicated_modules_sum_their_gradients_over_the_ranks():
    for errors in spawn(_replicated_norm, 2) + spawn(_replicated_norm, 3):
        assert max(errors) < 1e-5, errors


def _uneven_colwise(rank, world_size):
    """``nn.Linear(8, 10)`` under ``ColwiseParallel`` at three ranks: DTensor shards the weight's 10 rows 4, 4, 2,
    so the ops would see a different width on each rank (their agreement refused the backward). The layer runs as
    PyTorch's style runs it: output, input gradient and weight gradient equal to that style's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import flashoverlap.nn as fnn

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(8, 10), torch.randn(4, 8)
    got = {}
    for name, style in (("ours", fnn.ColwiseParallel()), ("pytorch", ColwiseParallel())):
        model = parallelize_module(copy.deepcopy(layer), mesh, style)
        x_r = x.clone().requires_grad_()
        y = model(x_r)
        y.pow(2).sum().backward()
        got[name] = (y.detach(), x_r.grad, model.weight.grad.to_local())
    return [float((ours - theirs).abs().max()) for ours, theirs in zip(got["ours"], got["pytorch"])]


def test_a_weight_whose_width_does_not_divide_runs_as_pytorchs_style():
    assert spawn(_uneven_colwise, 3) == [[0.0, 0.0, 0.0]] * 3
