"""flashoverlap.compile on fp8 graphs: ``torch._scaled_mm`` fed by an all-gather becomes ``all_gather_scaled_gemm``,
one feeding a reduce-scatter or an all-reduce ``scaled_gemm_reduce_scatter`` / ``scaled_gemm_all_reduce``.

On gloo ranks, compiled by Inductor (ATen kernels, as ``test_compile_pass.py`` compiles most of its graphs):
- graphs written by hand with functional collectives and ``torch._scaled_mm`` (tensor-wise scales from an amax
  all-reduce, row-wise scales all-gathered beside the rows, a bias, an added bias vector, the gathered input read
  again): compiled with the pass they equal the same function compiled without it, and the counts say which op each
  became; one of them at three ranks. The graphs a backend with fp8 collectives (NCCL) traces, fp8 gathered as
  itself, are rewritten too (traced and rewritten in the ranks, not run: gloo moves no fp8);
- torchao float8 models (``convert_to_float8_training``, recipes tensorwise and rowwise) sharded by torchao's own
  styles (``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput``, sequence parallel
  and not): compiled with the pass they are as close to the unsharded float8 model as compiled without it (output,
  input gradient, every parameter's gradient), with the rewrites counted. torchao's styles all-gather fp8, which
  gloo does not carry: ``_torchao_gathers_bytes`` (``tests/nn/test_float8_styles.py``) makes torchao gather the same
  bytes as uint8; the pass sees ``view.dtype`` around the gather and takes it as the fp8 gather it is.
In one process, on traced graphs: patterns the ops do not compute exactly are left, and the log says why."""

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import flashoverlap.compile as fc
from flashoverlap.testing import spawn

c10d = torch.ops._c10d_functional
F8, E5 = torch.float8_e4m3fn, torch.float8_e5m2
M, K, N = 12, 32, 16  # rows per rank, contracted, output columns


def _tensorwise(x, group, dtype=F8):
    """torchao's tensor-wise cast: the group's amax (an all-reduce MAX), so every rank has the same scale."""
    amax = c10d.wait_tensor(c10d.all_reduce(x.abs().max().float(), "max", group))
    scale = torch.finfo(dtype).max / amax.clamp_min(1e-12)
    return (x.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype), scale.reciprocal()


def _rowwise(x, dtype=F8):
    """A row-wise cast of this rank's rows: ``[rows, 1]`` scales of its own."""
    scale = torch.finfo(dtype).max / x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    return (x.float() * scale).to(dtype), scale.reciprocal()


def _gather(t, world, group):
    """All-gather of rows; fp8 as its bytes (gloo has no fp8), the way the byte-moving workaround writes it."""
    if t.dtype in (F8, E5):
        return c10d.wait_tensor(c10d.all_gather_into_tensor(t.view(torch.uint8), world, group)).view(t.dtype)
    return c10d.wait_tensor(c10d.all_gather_into_tensor(t, world, group))


def gather_tensorwise(x, w, world, group):  # colwise, sequence parallel: the fp8 input all-gathered, one scale
    x8, sx = _tensorwise(x, group)
    w8, sw = _tensorwise(w, group)
    return torch._scaled_mm(_gather(x8, world, group), w8.t(), sx, sw, out_dtype=torch.float32)


def gather_rowwise(x, w, world, group):  # row-wise scales gathered beside the rows; bias; the gathered rows reused
    x8, sx = _rowwise(x)
    w8, sw = _rowwise(w)
    full = _gather(x8, world, group)
    y = torch._scaled_mm(full, w8.t(), _gather(sx, world, group), sw.t(), bias=w[:, 0].to(torch.bfloat16),
                         out_dtype=torch.bfloat16)
    return y, full.float().sum(0)  # the gathered fp8 rows read again, as a weight gradient would


def gather_rows_repeated(x, w, world, group):  # torchao's styles under the rowwise recipe: one scale, repeated
    x8, sx = _tensorwise(x, group)
    w8, sw = _rowwise(w)
    scale_a = sx.reshape(1).repeat(M * world).reshape(-1, 1)
    return torch._scaled_mm(_gather(x8, world, group), w8.t(), scale_a, sw.t(), out_dtype=torch.bfloat16,
                            use_fast_accum=True)


def reduce_scatter_rowwise(x, w, world, group):  # rowwise, sequence parallel, with a bias on the product
    x8, sx = _rowwise(x)
    w8, sw = _rowwise(w)
    y = torch._scaled_mm(x8, w8.t(), sx, sw.t(), bias=w[:, 1].float(), out_dtype=torch.float32)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(y.view(world, -1, N), "sum", world, group)).view(-1, N)


def all_reduce_tensorwise_bias(x, w, world, group):  # rowwise, replicated: DTensor's bias / W added to the product
    x8, sx = _tensorwise(x, group)
    w8, sw = _tensorwise(w, group)
    y = torch._scaled_mm(x8, w8.t(), sx, sw, out_dtype=torch.bfloat16) + (w[:, 2] / world).to(torch.bfloat16)
    return c10d.wait_tensor(c10d.all_reduce(y, "sum", group))


HAND = {  # fn: (the counts the pass must report, relative tolerance against the function compiled without it)
    gather_tensorwise: ({"all_gather_scaled_gemm": 1}, 1e-6),
    gather_rowwise: ({"all_gather_scaled_gemm": 1}, 1e-2),
    gather_rows_repeated: ({"all_gather_scaled_gemm": 1}, 1e-2),
    reduce_scatter_rowwise: ({"scaled_gemm_reduce_scatter": 1}, 1e-5),
    all_reduce_tensorwise_bias: ({"scaled_gemm_all_reduce": 1}, 1e-2),
}


def _rel(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _compiled(fn, args, with_pass):
    torch._dynamo.reset()
    fc.reset_counts()
    if with_pass:
        fc.enable()
    try:
        out = torch.compile(fn, fullgraph=True, options={"fallback_by_default": True})(*args)
    finally:
        fc.disable()
    return out, fc.rewrite_counts()


def _direct_fp8_gather(group):
    """A gather of fp8 itself (NCCL's graphs; the gathered rows also returned), the scale from an amax all-reduce."""
    def fn(x8, w8, amax, sw):
        sx = c10d.wait_tensor(c10d.all_reduce(amax, "max", group)).reciprocal()
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(x8, 2, group))
        return torch._scaled_mm(full, w8.t(), sx, sw, out_dtype=torch.bfloat16), full

    return fn


def _hand_ranks(rank, world, names):
    import torch.distributed as dist

    torch._inductor.config.fx_graph_cache = False  # a cached graph would skip the pass
    group = dist.group.WORLD.group_name
    failures = {}
    torch.manual_seed(7)
    x = torch.randn(world, M, K).mul(torch.linspace(0.5, 4, world).view(-1, 1, 1))[rank]  # shards of unequal range
    w = torch.randn(N, K)
    for fn in (f for f in HAND if f.__name__ in names):
        expected, tolerance = HAND[fn]
        args = (x.to(torch.bfloat16), w.to(torch.bfloat16), world, group)
        want, none = _compiled(fn, args, False)
        got, counts = _compiled(fn, args, True)
        want, got = (t if isinstance(t, tuple) else (t,) for t in (want, got))
        errors = [_rel(g, h) for g, h in zip(got, want)]
        if counts != expected or none or not all(e <= tolerance for e in errors):
            failures[fn.__name__] = f"counts {counts} (expected {expected}), errors {errors} (tolerance {tolerance})"
    if world == 2:  # NCCL's form of the graph, fp8 gathered as fp8: rewritten (traced with fake tensors, not run)
        graph = make_fx(_direct_fp8_gather(group), tracing_mode="fake")(
            torch.randn(M, K).to(F8), torch.randn(N, K).to(F8), torch.ones(()), torch.ones(())).graph
        found = fc.rewrite(graph)
        if found != {"all_gather_scaled_gemm": 1} or "all_gather_into_tensor" in str(graph):
            failures["fp8 gathered as fp8"] = f"rewrote {found}"
    return failures


def test_hand_written_fp8_graphs_become_the_ops_and_compute_the_same():
    results = spawn(_hand_ranks, 2, args=([f.__name__ for f in HAND],))
    assert results == [{}, {}], results


def test_an_fp8_gather_at_three_ranks():
    results = spawn(_hand_ranks, 3, args=(["gather_rowwise"],))
    assert results == [{}, {}, {}], results


# -- torchao float8 models under torchao's own styles ----------------------------------------------------------------
TORCHAO = {  # (recipe, plan): the counts the pass must report, forward and backward
    # sequence parallel: the gathers before up (forward) and down (backward, the output gradient), the
    # reduce-scatters after down (forward, with DTensor's bias / W) and up (backward, the input gradient).
    ("tensorwise", "sequence"): {"all_gather_scaled_gemm": 2, "scaled_gemm_reduce_scatter": 2},
    # torchao's input cast is tensor-wise whatever the recipe (one scale repeated over the rows): gathers taken; the
    # backward input gradient is scaled after its _scaled_mm (rounded, then scaled): that reduce-scatter is left.
    ("rowwise", "titan"): {"all_gather_scaled_gemm": 2, "scaled_gemm_reduce_scatter": 1},
}


def _torchao_ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8 import float8_tensor_parallel as styles

    from tests.nn.test_float8_styles import _SEQUENCE_IN, _SEQUENCE_OUT, Model, _plan, _torchao_gathers_bytes
    from tests.nn.test_float8_styles import _rel as rel

    torch._inductor.config.fx_graph_cache = False
    mesh = init_device_mesh("cpu", (world,))
    _torchao_gathers_bytes()
    failures = {}
    for (recipe, plan), expected in TORCHAO.items():
        torch.manual_seed(1)
        full = convert_to_float8_training(Model(torch.bfloat16), config=Float8LinearConfig.from_recipe_name(recipe))
        x, dy = torch.randn(2, 1, 16, 32, dtype=torch.bfloat16).unbind(0)
        x_full = x.clone().requires_grad_(True)
        y_full = full(x_full)
        y_full.backward(dy)

        def mine(t, sharded):
            return t.tensor_split(world, dim=1)[rank] if sharded else t

        errors = {}
        for with_pass in (False, True):
            model = parallelize_module(copy.deepcopy(full), mesh, _plan(styles, plan))
            x_local = mine(x, plan in _SEQUENCE_IN).clone().requires_grad_(True)
            torch._dynamo.reset()
            fc.reset_counts()
            if with_pass:
                fc.enable()
            try:  # the backward graph is compiled at the first backward: the pass on until then
                y = torch.compile(model, fullgraph=True, options={"fallback_by_default": True})(x_local)
                y.backward(mine(dy, plan in _SEQUENCE_OUT))
            finally:
                fc.disable()
            errors[with_pass] = {"y": rel(y, mine(y_full, plan in _SEQUENCE_OUT)),
                                 "x.grad": rel(x_local.grad, mine(x_full.grad, plan in _SEQUENCE_IN))}
            errors[with_pass].update({n + ".grad": rel(p.grad, q.grad) for (n, p), q in zip(
                model.named_parameters(), full.parameters())})
            errors[with_pass]["counts"] = fc.rewrite_counts()
        counts = errors[True].pop("counts")
        assert not errors[False].pop("counts")
        worse = {k: (v, errors[False][k]) for k, v in errors[True].items() if not v <= 1.5 * errors[False][k] + 2e-3}
        if counts != expected or worse:
            failures[(recipe, plan)] = f"counts {counts} (expected {expected}); worse than without the pass: {worse}"
    return failures


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("torchao") is None, reason="torchao not installed")
def test_torchao_float8_models_compiled_with_the_pass_match_as_without_it():
    assert spawn(_torchao_ranks, 2) == [{}, {}]


# -- in one process: what the ops would not compute exactly is left, and the log says why ----------------------------
def _fp8(*shape):
    return torch.randn(shape).to(F8)


def test_fp8_patterns_the_ops_do_not_compute_are_left(caplog):
    def avg(a, b, sa, sb):  # a mean, not a sum
        return c10d.wait_tensor(c10d.all_reduce(torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16), "avg",
                                                "0"))

    def fp16_out(a, b, sa, sb):  # an output dtype the ops do not give
        return c10d.wait_tensor(c10d.all_reduce(torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.float16), "sum",
                                                "0"))

    def result_scale(a, b, sa, sb):
        y = torch._scaled_mm(a, b.t(), sa, sb, scale_result=sa, out_dtype=torch.bfloat16)
        return c10d.wait_tensor(c10d.all_reduce(y, "sum", "0"))

    def mixed_modes(a, b, sa, sb):  # row-wise A, one scale for B: no mode of the ops
        y = torch._scaled_mm(a, b.t(), sa.expand(a.shape[0], 1).contiguous(), sb.view(1, 1), out_dtype=torch.bfloat16)
        return c10d.wait_tensor(c10d.all_reduce(y, "sum", "0"))

    def local_scale_gathered(a, b, sa, sb):  # each rank's own scale for every gathered row: not the shards' own
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(a, 2, "0"))
        return torch._scaled_mm(full, b.t(), sa, sb, out_dtype=torch.bfloat16)

    reasons = {avg: "reduce op 'avg'", fp16_out: "out_dtype must be torch.bfloat16 or torch.float32",
               # at K = 32 and N = 16 the scales [8, 1] and [1, 1] are block-wise's shapes: the check says what
               # block-wise needs of K (before 'fit no scaling mode', which it says elsewhere)
               result_scale: "scale_result", mixed_modes: "block-wise scaling needs K (a's columns) a multiple of 128",
               local_scale_gathered: "neither all-gathered with it nor shown to be the same"}
    for fn, reason in reasons.items():
        graph = make_fx(fn, tracing_mode="fake")(_fp8(8, 32), _fp8(16, 32), torch.ones(()), torch.ones(())).graph
        before = str(graph)
        caplog.clear()
        with caplog.at_level("DEBUG", logger="flashoverlap.compile"):
            assert fc.rewrite(graph) == {}, fn.__name__
        assert str(graph) == before, fn.__name__
        assert any(reason in r.getMessage() for r in caplog.records), (fn.__name__, [r.getMessage() for r in
                                                                                    caplog.records])
