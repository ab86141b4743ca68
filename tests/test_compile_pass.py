"""flashoverlap.compile: the Inductor post-grad pass that rewrites matmul + functional collectives into the library's
ops. A torchtitan-style decoder layer written with PyTorch's own styles (SequenceParallel norms, PrepareModuleInput,
ColwiseParallel, RowwiseParallel), compiled on two gloo ranks with full Inductor code generation, sequence
parallel and not: the number of rewrites of each op is asserted, every collective left in the compiled graphs is
checked (by a matcher written here, independent of the pass) not to be a rewritable one, outputs and gradients equal
the eager run; with PyTorch's async-TP pass on as well, the same. In one process, on traced graphs: a graph
without such patterns, and graphs whose collective is not exactly a row gather/scatter of one matmul, come out
unchanged; the switch keeps other passes and leaves the config as it found it."""

import copy
import operator

import torch
import torch.distributed as dist
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import flashoverlap.compile as fc
from flashoverlap.testing import spawn

DIM, HEADS, FFN = 32, 4, 48
c10d = torch.ops._c10d_functional


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    """torchtitan's layout and names."""

    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def titan_plan(sequence_parallel: bool) -> dict:
    """torchtitan's per-layer plan (``parallelize_llama``), with PyTorch's styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        return {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()}
    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    return {"attention_norm": SequenceParallel(), "attention": PrepareModuleInput(**gather),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(), "feed_forward": PrepareModuleInput(**gather),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}


# -- an independent matcher: is a collective left in a graph one the pass should have taken? -----------------------
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _through_views(node):
    while node.target in _VIEWS:
        node = node.args[0]
    return node


def _rewritable(collective) -> bool:
    """A reduction whose input is (reshapes of) one matmul product read by nothing else, or an all-gather whose
    result (through reshapes) a matmul reads as its left operand."""
    if collective.target in (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default):
        source = collective.args[0]
        if source.target is torch.ops.aten.cat.default:  # DTensor's chunking for a later scatter dimension
            source = source.args[0][0].args[0].args[0]
        producer = _through_views(source)
        return producer.target is torch.ops.aten.mm.default and len(producer.users) == 1
    stack = [collective]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.target in (*_VIEWS, c10d.wait_tensor.default):
                stack.append(user)
            elif user.target is torch.ops.aten.mm.default and user.args[0] is node:
                return True
    return False


def _compiled_layer(rank, world_size, sequence_parallel, async_tp, codegen):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    torch._inductor.config.fx_graph_cache = False  # a cached graph would skip the passes
    torch.manual_seed(3)
    full = DecoderLayer()
    x = torch.randn(1, 12, DIM)
    layer = parallelize_module(full, mesh, titan_plan(sequence_parallel))
    x_local = x.tensor_split(world_size, dim=1)[rank] if sequence_parallel else x

    def step(model):
        x_in = x_local.clone().requires_grad_(True)
        y = model(x_in)
        y.pow(2).sum().backward()
        grads = {n.removeprefix("_orig_mod."): getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
                 for n, p in model.named_parameters()}
        model.zero_grad()
        return y.detach(), x_in.grad, grads

    want = step(layer)
    graphs = []

    class Record(torch._inductor.custom_graph_pass.CustomGraphPass):  # after ours: the graphs as they end up
        def __call__(self, graph):
            graphs.append(graph)

        def uuid(self):
            return None  # no caching: every run must reach the pass

    fc.reset_counts()
    torch._inductor.config._micro_pipeline_tp = async_tp
    fc.enable()
    torch._inductor.config.post_grad_custom_post_pass = [torch._inductor.config.post_grad_custom_post_pass, Record()]
    # Inductor's C++ code generation once (the ops lower into real compiled code); ATen kernels otherwise, the same
    # graphs and passes at a fraction of the compile time on two cores.
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True,
                             options=None if codegen else {"fallback_by_default": True})
    got = step(compiled)
    fc.disable()
    counts = fc.rewrite_counts()
    failures = []
    if torch._inductor.config.post_grad_custom_post_pass.__class__ is not Record:
        failures.append("disable() did not leave the other pass in place")
    torch._inductor.config.post_grad_custom_post_pass = None
    torch._inductor.config._micro_pipeline_tp = False

    left = [n for g in graphs for n in g.nodes if n.target in (c10d.all_reduce.default, c10d.all_gather_into_tensor
                                                               .default, c10d.reduce_scatter_tensor.default)]
    failures += [f"{n.name} ({n.target}) left although rewritable" for n in left if _rewritable(n)]
    ours = [n for g in graphs for n in g.nodes if getattr(n.target, "namespace", None) == "flashoverlap"]
    if len(graphs) != 2:
        failures.append(f"{len(graphs)} graphs compiled, expected a forward and a backward")
    for name, a, b in (("y", got[0], want[0]), ("x.grad", got[1], want[1]),
                       *((n, got[2][n], want[2][n]) for n in want[2])):
        if not float((a - b).norm() / b.norm()) < 1e-5:
            failures.append(f"{name} differs from eager")
    return counts, len(ours), sorted(str(n.target) for n in left), failures


SCENARIOS = {
    # Forward: the all-gathers before attention and the feed-forward (each fused with its widest matmul), the
    # reduce-scatters after wo and w2; backward: the all-gathers of wo's and w2's output gradients. Left: the
    # backward reduce-scatters of a sum of matmuls (q + k + v, w1 + w3) and the norms' weight-gradient reductions.
    "sequence-parallel": ((True, False, True), {"all_gather_gemm": 4, "gemm_reduce_scatter": 2}),
    # Forward: the all-reduces after wo and w2; backward: the all-reduce of each colwise projection's input
    # gradient (PyTorch reduces each of q, k, v, w1, w3 on its own).
    "replicated": ((False, False, False), {"gemm_all_reduce": 7}),
    # PyTorch's async TP on too: on groups without symmetric memory (gloo here) it leaves every pattern to us.
    "with-async-tp": ((True, True, False), {"all_gather_gemm": 4, "gemm_reduce_scatter": 2}),
}


def _scenarios(rank, world_size):
    results = {}
    for name, (args, _) in SCENARIOS.items():
        torch._dynamo.reset()
        results[name] = _compiled_layer(rank, world_size, *args)
    return results


def test_decoder_layer_patterns_are_all_rewritten():
    for rank, results in enumerate(spawn(_scenarios, 2)):  # one pair of processes for the three compilations
        for name, (counts, ours, left, failures) in results.items():
            expected = SCENARIOS[name][1]
            assert counts == expected, f"{name}, rank {rank}: rewrote {counts}, expected {expected}"
            assert ours == sum(expected.values()), f"{name}, rank {rank}: {ours} flashoverlap ops compiled"
            assert not failures, f"{name}, rank {rank}: {failures} (collectives left: {left})"


# -- in one process, on traced graphs ------------------------------------------------------------------------------
def _traced(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes)).graph


def _unchanged(graph):
    before = str(graph)
    assert fc.rewrite(graph) == {}
    assert str(graph) == before


def test_graphs_without_the_patterns_are_unchanged():
    _unchanged(_traced(lambda a, b: torch.relu(torch.mm(a, b)) + 1, (8, 4), (4, 6)))


def test_collectives_that_are_not_exactly_the_ops_are_left():
    def average(a, b):  # a mean, not a sum
        return c10d.wait_tensor(c10d.all_reduce(torch.mm(a, b), "avg", "0"))

    def product_read_twice(a, b):  # the product is needed whole elsewhere
        y = torch.mm(a, b)
        return c10d.wait_tensor(c10d.all_reduce(y, "sum", "0")), y.sum()

    def not_a_matmul(a, b):
        return c10d.wait_tensor(c10d.all_reduce(a @ b + 1, "sum", "0"))

    def gathered_along_batch_rows(x, w):  # Shard(1) of [2, S, H]: DTensor's split + cat, not rows
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, "0"))
        full = torch.cat(torch.split(gathered, 2), dim=1)
        return torch.mm(full.reshape(-1, 4), w)

    def gathered_then_transposed(x, w):  # the gathered rows as a matmul's right operand
        return torch.mm(w, c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, "0")))

    def summed(a, b):  # the op's pattern, on empty operands below (the ops take M, N, K >= 1)
        return c10d.wait_tensor(c10d.all_reduce(torch.mm(a, b), "sum", "0"))

    def scattered(a, b):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.mm(a, b), "sum", 2, "0"))

    def gathered(x, w):
        return torch.mm(c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, "0")), w)

    for fn, shapes in ((average, ((8, 4), (4, 6))), (product_read_twice, ((8, 4), (4, 6))),
                       (not_a_matmul, ((8, 4), (4, 6))), (gathered_along_batch_rows, ((2, 3, 4), (4, 6))),
                       (gathered_then_transposed, ((3, 4), (5, 6))), (summed, ((0, 4), (4, 6))),
                       (summed, ((8, 0), (0, 6))), (scattered, ((0, 4), (4, 6))), (gathered, ((0, 4), (4, 6))),
                       (gathered, ((3, 0), (0, 6)))):
        _unchanged(_traced(fn, *shapes))


def test_a_matmul_all_reduce_becomes_the_op():
    def layer(a, b):
        return c10d.wait_tensor(c10d.all_reduce(torch.mm(a, b).view(2, 4, 6), "sum", "0"))

    graph = _traced(layer, (8, 4), (4, 6))
    assert fc.rewrite(graph) == {"gemm_all_reduce": 1}
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.ops.flashoverlap.gemm_all_reduce.default in targets
    assert not {c10d.all_reduce.default, c10d.wait_tensor.default, torch.ops.aten.mm.default} & set(targets)
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    assert out.meta["val"].shape == (2, 4, 6)


def test_the_switch_keeps_other_passes_and_restores_the_config():
    config = torch._inductor.config
    assert config.post_grad_custom_post_pass is None and not fc.is_enabled()
    other = operator.truth  # stands for a user's own pass
    config.post_grad_custom_post_pass = other
    try:
        with fc.enabled():
            assert fc.is_enabled() and config.post_grad_custom_post_pass[0] is other
            fc.enable()  # idempotent
            assert len(config.post_grad_custom_post_pass) == 2
        assert config.post_grad_custom_post_pass is other and not fc.is_enabled()
    finally:
        config.post_grad_custom_post_pass = None


def test_turning_the_pass_on_or_off_resets_compiled_code(monkeypatch):
    """Compiled code is kept per ``forward`` function, not per setting: a switch that changes the setting resets
    ``torch.compile``'s caches (else a model compiled before runs its old code, with or without the pass, under a
    new ``torch.compile`` too); a switch that changes nothing does not."""
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(fc.is_enabled()))
    try:
        fc.enable()
        fc.enable()
        fc.disable()
        fc.disable()
        assert resets == [True, False]
        with fc.enabled():  # a scoped setting: no reset (what compiles inside keeps its rewrites)
            assert fc.is_enabled()
        assert resets == [True, False] and not fc.is_enabled()
    finally:
        torch._inductor.config.post_grad_custom_post_pass = None


def test_rewrites_are_logged_at_debug(caplog):
    graph = _traced(lambda a, b: c10d.wait_tensor(c10d.all_reduce(torch.mm(a, b), "sum", "0")), (8, 4), (4, 6))
    with caplog.at_level("DEBUG", logger="flashoverlap.compile"):
        fc.rewrite(graph)
    assert any("into flashoverlap::gemm_all_reduce" in r.getMessage() for r in caplog.records)
    assert dist.is_available()
