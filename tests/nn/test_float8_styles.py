"""flashoverlap.nn.Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput on torchao float8 models
(``convert_to_float8_training``, recipes tensorwise and rowwise) under ``parallelize_module`` on gloo ranks (the fp8
ops' reference path): a block sharded with these styles and the same block sharded with torchao's own styles, each
against the unsharded float8 block (output, input gradient, every parameter's gradient). Ours must be as close as
torchao's (``<= FACTOR * torchao's + EPS``) and within ``LIMIT`` (the rounding of the partial sums to bf16, or fp32:
the casts are the unsharded model's; row-wise products are rounded to bf16, as torchao rounds them). Which of the
library's fp8 ops ran, forward and backward, eager and compiled; a ``PrepareFloat8ModuleInput`` plan (the shared
fp8 input runs as torchao's); the styles with their amax all-reduce dropped fail the same check; torchao's errors on
a plain ``nn.Linear``; and without torchao, ``import flashoverlap.nn`` works and the styles say how to install it.

torchao's styles all-gather fp8 tensors, which gloo does not carry: ``_torchao_gathers_bytes`` makes torchao's fp8
all-gather move the same bytes as uint8 (values unchanged), in the ranks only."""

import collections
import copy
import importlib.util
import sys

import pytest
import torch
from torch import nn

from flashoverlap.testing import spawn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao is not installed (pip install \"torchao>=0.10\")")

HIDDEN, INNER, SEQ = 32, 64, 16  # torchao's scaled matmul wants multiples of 16
FACTOR = 2.0
COMPILE_BACKEND = "aot_eager"
EPS = {torch.bfloat16: 2e-3, torch.float16: 1e-3, torch.float32: 1e-5}
LIMIT = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
_SEQUENCE_IN = {"sequence", "titan", "dtensor", "gathered"}  # plans whose input is sharded on the sequence
_SEQUENCE_OUT = {"sequence", "titan", "dtensor"}  # ... and whose output is
_OPS = {  # the library's fp8 ops each plan's forward and backward run (torchao's shared gather for titan's up)
    "sequence": {"all_gather_scaled_gemm": 2, "scaled_gemm_reduce_scatter": 2},
    "replicate": {"scaled_gemm_all_reduce": 2},
    "titan": {"scaled_gemm_reduce_scatter": 1, "all_gather_scaled_gemm": 1},
    "dtensor": {"all_gather_scaled_gemm": 2, "scaled_gemm_reduce_scatter": 2},
    "gathered": {"all_gather_scaled_gemm": 1, "scaled_gemm_reduce_scatter": 1},  # down is not sharded
}


class Block(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.up = nn.Linear(HIDDEN, INNER, dtype=dtype)
        self.down = nn.Linear(INNER, HIDDEN, dtype=dtype)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    """A block inside a model, so that a ``PrepareFloat8ModuleInput`` on the block runs inside the model's forward."""

    def __init__(self, dtype):
        super().__init__()
        self.block = Block(dtype)

    def forward(self, x):
        return self.block(x)


def _plan(styles, plan):
    from torch.distributed.tensor import Replicate, Shard

    col, row = styles.Float8ColwiseParallel, styles.Float8RowwiseParallel
    return {
        "sequence": {"block.up": col(input_layouts=Shard(1)), "block.down": row(output_layouts=Shard(1))},
        "replicate": {"block.up": col(), "block.down": row()},
        "titan": {"block": styles.PrepareFloat8ModuleInput(input_layouts=(Shard(1),),
                                                           desired_input_layouts=(Replicate(),)),
                  "block.up": col(), "block.down": row(output_layouts=Shard(1))},
        "dtensor": {"block.up": col(input_layouts=Shard(1), use_local_output=False),
                    "block.down": row(output_layouts=Shard(1), use_local_output=False)},
        "gathered": {"block.up": col(input_layouts=Shard(1), output_layouts=Replicate())},
    }[plan]


def _rel(got, want):
    got, want = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (got, want))
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _torchao_gathers_bytes():
    """torchao's fp8 all-gather (``float8_ops.allgather_fp8``) on the data viewed as uint8: gloo has no fp8."""
    import torchao.float8.float8_ops as float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    def gather(aten_op, args, kwargs=None):
        fp8 = args[0]
        data = aten_op(fp8._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
        return Float8TrainingTensor(data.view(fp8._data.dtype), fp8._scale, fp8._orig_dtype,
                                    fp8._linear_mm_config, fp8._gemm_input_role)

    for op in (torch.ops._c10d_functional.all_gather_into_tensor.default,
               torch.ops.c10d_functional.all_gather_into_tensor.default):
        float8_ops.FLOAT8_OPS_TABLE[op] = gather


def _ops_seen():
    """The names of the library's ops that run from now on (eager, and compiled: their custom ops' bodies)."""
    import flashoverlap.ops.scaled as scaled

    seen = []
    execute = scaled.execute

    def counted(kind, spec):
        seen.append(spec.name)
        return execute(kind, spec)

    scaled.execute = counted
    return seen


def _case(rank, world, mesh, case, seen):
    """One case: the block sharded by torchao's styles and by ours, each against the unsharded float8 block.
    Returns the failures found and the relative errors ``{what: (ours, torchao's)}``."""
    import torchao.float8.float8_tensor_parallel as torchao_styles
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import flashoverlap.nn as fnn

    recipe, plan, batch, dtype, compiled = case
    torch.manual_seed(1)
    full = convert_to_float8_training(Model(dtype), config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(batch, SEQ, HIDDEN, dtype=dtype)
    dy = torch.randn(batch, SEQ, HIDDEN, dtype=dtype)  # a fixed output gradient: no loss of y's rounding
    x_full = x.clone().requires_grad_(True)
    y_full = full(x_full)
    y_full.backward(dy)

    def mine(t, sharded):
        return t.tensor_split(world, dim=1)[rank] if sharded else t

    want = {"y": mine(y_full, plan in _SEQUENCE_OUT), "x.grad": mine(x_full.grad, plan in _SEQUENCE_IN)}
    want.update({name + ".grad": p.grad for name, p in full.named_parameters()})
    errors, ops, layouts = {}, {}, {}
    for name, styles in (("torchao", torchao_styles), ("ours", fnn)):
        model = parallelize_module(copy.deepcopy(full), mesh, _plan(styles, plan))
        run = model
        if compiled and name == "ours":
            torch._dynamo.reset()
            # "dynamic": symbolic shapes from the first call (the casts' amax all-reduce traced outside the
            # autograd functions: inside, Dynamo failed)
            run = torch.compile(model, fullgraph=True, backend=COMPILE_BACKEND, dynamic=compiled == "dynamic" or None)
        x_local = mine(x, plan in _SEQUENCE_IN).clone().requires_grad_(True)
        seen.clear()
        y = run(x_local)
        y_local = y.to_local() if isinstance(y, DTensor) else y
        y_local.backward(mine(dy, plan in _SEQUENCE_OUT))
        ops[name] = collections.Counter(seen)
        got = {"y": y_local, "x.grad": x_local.grad}
        got.update({n + ".grad": p.grad for n, p in model.named_parameters()})
        layouts[name] = {what: getattr(t, "placements", "local") for what, t in
                         [("y", y)] + [(n + ".grad", p.grad) for n, p in model.named_parameters()]}
        errors[name] = {what: _rel(got[what], want[what]) for what in want}
    # Row-wise products come out in bf16 (torchao's rule) whatever the model's dtype; titan's shared input is
    # torchao's cast (tensor-wise whatever the recipe), so only the comparison with torchao's styles holds there.
    rounding = torch.bfloat16 if recipe == "rowwise" else dtype
    limit = LIMIT[rounding] if plan != "titan" else float("inf")
    failures = []
    for what, ours in errors["ours"].items():
        theirs = errors["torchao"][what]
        if not (ours <= FACTOR * theirs + EPS[rounding] and ours <= limit):
            failures.append(f"{what}: {ours:.2e} from the unsharded model, torchao's styles {theirs:.2e}")
    if layouts["ours"] != layouts["torchao"]:
        failures.append(f"types and placements: ours {layouts['ours']}, torchao's {layouts['torchao']}")
    if ops["ours"] != _OPS[plan] or ops["torchao"]:
        failures.append(f"ops ran: ours {dict(ops['ours'])}, expected {_OPS[plan]}; torchao's {dict(ops['torchao'])}")
    return failures, {what: (errors["ours"][what], errors["torchao"][what]) for what in want}


def _without_torchao():
    """``import flashoverlap.nn`` with torchao unimportable, and what constructing a float8 style then says."""
    if "flashoverlap.nn" in sys.modules:  # imported with torchao at hand: the check would prove nothing
        return ["flashoverlap.nn was imported before the check (a rank forked from a server that imports it?)"]
    names = ("torchao", "torchao.float8")
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(dict.fromkeys(names))  # None: `import torchao...` raises ImportError
    failures = []
    try:
        import flashoverlap.nn as fnn

        for style in (fnn.Float8ColwiseParallel, fnn.Float8RowwiseParallel, fnn.PrepareFloat8ModuleInput):
            try:
                style()
                failures.append(f"{style.__name__}() without torchao raised nothing")
            except ImportError as error:
                if 'pip install "torchao>=0.10"' not in str(error):
                    failures.append(f"{style.__name__}() without torchao: {error}")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return failures


def _errors_as_torchaos(mesh):
    """A plain ``nn.Linear`` refused as torchao's styles refuse it."""
    from torch.distributed.tensor.parallel import parallelize_module

    import flashoverlap.nn as fnn

    for style in (fnn.Float8ColwiseParallel(), fnn.Float8RowwiseParallel()):
        with pytest.raises(ValueError, match="expecting module to be Float8Linear"):
            parallelize_module(nn.Linear(HIDDEN, INNER), mesh, style)


def _ranks(rank, world, cases, checks):
    from torch.distributed.device_mesh import init_device_mesh

    results = {"without torchao": (_without_torchao(), {})} if "without_torchao" in checks else {}
    mesh = init_device_mesh("cpu", (world,))
    _torchao_gathers_bytes()
    seen = _ops_seen()
    for case in cases:
        results[" ".join(map(str, case))] = _case(rank, world, mesh, case, seen)
    if "broken" in checks:
        # The styles with every amax local (no all-reduce): the same check must fail.
        import flashoverlap.nn.float8 as float8

        cast = float8._cast
        float8._cast = lambda t, how, axis, split, mesh: cast(t, how, axis, False, mesh)
        failures, errors = _case(rank, world, mesh, ("tensorwise", "sequence", 1, torch.bfloat16, False), seen)
        float8._cast = cast
        results["broken: amax not all-reduced"] = (["the check passed"] if not failures else [], errors)
    if "errors" in checks:
        _errors_as_torchaos(mesh)
    return results


def _check(results):
    bad = {(rank, case): failures for rank, result in enumerate(results)
           for case, (failures, _) in result.items() if failures}
    assert not bad, bad
    for case, (_, errors) in results[0].items():  # the figures, in the report (pytest -rP)
        print(case, {what: f"{ours:.1e} (torchao {theirs:.1e})" for what, (ours, theirs) in errors.items()})


CASES_2 = [
    ("tensorwise", "sequence", 1, torch.bfloat16, False),
    ("rowwise", "sequence", 1, torch.bfloat16, False),
    ("tensorwise", "sequence", 2, torch.float32, False),  # B > 1: the shard moved sequence-major and back
    ("tensorwise", "sequence", 1, torch.float16, False),  # the ops give fp32, rounded to fp16
    ("tensorwise", "replicate", 2, torch.bfloat16, False),
    ("rowwise", "replicate", 1, torch.float32, False),  # row-wise products through bf16, as torchao's
    ("rowwise", "titan", 1, torch.bfloat16, False),
    ("rowwise", "dtensor", 1, torch.bfloat16, False),  # DTensor outputs, a DTensor input to the rowwise linear
    ("tensorwise", "gathered", 1, torch.bfloat16, False),  # the colwise output all-gathered (bf16)
    ("tensorwise", "sequence", 2, torch.bfloat16, True),
    ("rowwise", "sequence", 2, torch.bfloat16, "dynamic"),
]
CASES_4 = [
    ("tensorwise", "sequence", 1, torch.bfloat16, False),
    ("rowwise", "sequence", 2, torch.bfloat16, False),
]


def test_float8_styles_at_two_ranks_match_the_unsharded_model_as_torchaos_do():
    _check(spawn(_ranks, 2, args=(CASES_2, ("without_torchao", "broken", "errors"))))


def test_float8_styles_at_four_ranks_match_the_unsharded_model_as_torchaos_do():
    _check(spawn(_ranks, 4, args=(CASES_4, ())))
