"""A ``torch.compile`` pass that puts flashoverlap's ops into models written with PyTorch's own tensor parallelism.

One switch: ``flashoverlap.compile.enable()`` (``disable()``; ``enabled()`` as a context manager) registers an
Inductor post-grad pass (``torch._inductor.config.post_grad_custom_post_pass``, beside any pass already there) that
rewrites, in every graph compiled afterwards, forward and backward alike, the matmul + functional-collective
patterns that DTensor (PyTorch's ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel``) emits:

- ``all_gather_into_tensor(x) -> wait_tensor -> [reshape] -> mm(., b)`` (or ``addmm(bias, ., b)``, a linear with a
  bias) into ``flashoverlap::all_gather_gemm(x, b)``: its gathered input replaces the all-gather's result for every
  other reader, such as the copy saved for backward; where several matmuls read one all-gather (q, k and v), the
  widest is fused and the others read the gathered input;
- ``mm(a, b) -> [reshape] -> reduce_scatter_tensor(sum) -> wait_tensor`` into ``flashoverlap::gemm_reduce_scatter``;
- ``mm(a, b) -> [reshape] -> all_reduce(sum) -> wait_tensor`` into ``flashoverlap::gemm_all_reduce``.

A pattern is rewritten only where the result is exactly the same: a sum; rows gathered or scattered along the
first dimension, or along a later one when every dimension before it has size 1 (``Shard(1)`` of ``[1, S, H]``, as
DTensor sequence parallelism does at batch 1: the same bytes); reshapes that only regroup the rows of a contiguous
tensor; a matmul whose product nothing else reads (a reduction) and whose right operand does not depend on the
gathered input; bf16, fp16 or fp32. Everything else, and every graph without such patterns, is left as it was
(``Shard(1)`` of a batch above 1 among them: DTensor gathers it by split and cat, which the ops' row layout does
not express without copies). The process group is the collective's own: the ops take the same ``group_name``.

What was rewritten, and why a candidate was left, is logged at DEBUG on the ``flashoverlap.compile`` logger;
``rewrite_counts()`` tells how many of each were rewritten in this process.

With PyTorch's async TP on too (``torch._inductor.config._micro_pipeline_tp = True``): Inductor runs PyTorch's pass
first, and this one after it, on what is left. On groups with symmetric memory enabled PyTorch's pass takes the
all-gather and reduce-scatter patterns (into ``torch.ops.symm_mem.fused_*``) and this pass the all-reduces, which
PyTorch's pass has no fused op for; on other groups (no symmetric memory: PCIe, several nodes, gloo) PyTorch's
pass leaves them all and this pass takes them. To have flashoverlap's ops everywhere, leave PyTorch's switch off.

Graphs are cached by Inductor with this pass's identity (a hash of this file); a model already compiled keeps
the code it was compiled with: enable the pass before the first call of the compiled model.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections import Counter
from collections.abc import Iterator

import torch
import torch.fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from flashoverlap.ops import library  # noqa: F401  (torch.ops.flashoverlap.*)
from flashoverlap.runtime.checks import DTYPES

__all__ = ["disable", "enable", "enabled", "is_enabled", "reset_counts", "rewrite", "rewrite_counts"]

_LOG = logging.getLogger("flashoverlap.compile")
_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
_SPLITS = (_aten.split.Tensor, _aten.split_with_sizes.default)
_DTYPES = DTYPES  # the ops' one dtype rule (runtime/checks.py)
_COUNTS: Counter = Counter()


# -- the switch ----------------------------------------------------------------------------------------------------
class _FlashOverlapPass(CustomGraphPass):
    """The post-grad pass: ``rewrite`` on each graph; identified by this file's contents for Inductor's cache."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewrite(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


_PASS = _FlashOverlapPass()


def _registered() -> list:
    current = inductor_config.post_grad_custom_post_pass
    if current is None:
        return []
    return list(current) if isinstance(current, (list, tuple)) else [current]


def enable() -> None:
    """Rewrite matmul + collective patterns into flashoverlap's ops in every graph ``torch.compile`` compiles from
    now on (idempotent; keeps any other post-grad pass registered)."""
    passes = _registered()
    if _PASS not in passes:
        passes.append(_PASS)
    inductor_config.post_grad_custom_post_pass = passes[0] if len(passes) == 1 else passes


def disable() -> None:
    """Stop rewriting (graphs compiled while it was on keep their rewrites); other post-grad passes stay."""
    passes = [p for p in _registered() if p is not _PASS]
    inductor_config.post_grad_custom_post_pass = (None if not passes else passes[0] if len(passes) == 1
                                                  else passes)


def is_enabled() -> bool:
    return _PASS in _registered()


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``enable()`` for the duration of a ``with`` block, then back to how it was."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()


def rewrite_counts() -> dict[str, int]:
    """How many patterns this process has rewritten, by op (``all_gather_gemm``, ``gemm_reduce_scatter``,
    ``gemm_all_reduce``)."""
    return dict(_COUNTS)


def reset_counts() -> None:
    _COUNTS.clear()


# -- matching --------------------------------------------------------------------------------------------------------
def _arg(node: torch.fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _leading_ones(shape, dim: int) -> bool:
    return all(size == 1 for size in shape[:dim])


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for inp in stack.pop().all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                stack.append(inp)
    return seen


def _split_cat(cat: torch.fx.Node) -> tuple[torch.fx.Node, int, int, int] | None:
    """``cat([getitem(split(src, n, split_dim), 0), ..., getitem(.., k-1)], cat_dim)`` with every piece of the split
    taken once, in order: ``(src, split_dim, cat_dim, k)``; None for anything else."""
    if cat.target is not _aten.cat.default:
        return None
    pieces = _arg(cat, 0, "tensors")
    cat_dim = _arg(cat, 1, "dim") or 0
    if not isinstance(pieces, (list, tuple)) or not pieces or not isinstance(cat_dim, int):
        return None
    split = None
    for index, piece in enumerate(pieces):
        if not (isinstance(piece, torch.fx.Node) and piece.target is operator.getitem and piece.args[1] == index):
            return None
        if split is None:
            split = piece.args[0]
        elif piece.args[0] is not split:
            return None
    if not isinstance(split, torch.fx.Node) or split.target not in _SPLITS:
        return None
    src, split_dim = split.args[0], _arg(split, 2, "dim") or 0
    val = _val(split)
    if not isinstance(src, torch.fx.Node) or val is None and not isinstance(split.meta.get("val"), (list, tuple)):
        return None
    if len(split.meta.get("val", ())) != len(pieces):  # every piece, once
        return None
    src_val = _val(src)
    if src_val is None:
        return None
    return src, split_dim % src_val.ndim, cat_dim % src_val.ndim, len(pieces)


def _bias_addmm(node: torch.fx.Node, a: torch.fx.Node) -> bool:
    """``addmm(bias, a, b)`` with a bias of the product's last dimension and ``alpha = beta = 1`` (``F.linear``
    with a bias): the same as ``a @ b + bias``."""
    if node.target is not _aten.addmm.default or node.args[1] is not a or len(node.args) > 3:
        return False
    if any(node.kwargs.get(name, 1) != 1 for name in ("alpha", "beta")):
        return False
    bias, out = _val(node.args[0]), _val(node)
    return bias is not None and out is not None and bias.ndim == 1 and bias.shape[0] == out.shape[-1]


def _operands(mm: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """A matmul's ``(a, b)``, of ``mm(a, b)`` or ``addmm(bias, a, b)``."""
    return (mm.args[1], mm.args[2]) if mm.target is _aten.addmm.default else (mm.args[0], mm.args[1])


class _Rewriter:
    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.erased: set[torch.fx.Node] = set()
        self.changed = False

    # -- graph surgery ----------------------------------------------------------------------------------------------
    def _call(self, target, args: tuple, before: torch.fx.Node) -> torch.fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args)
        vals = torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))
        from torch._guards import detect_fake_mode

        mode = detect_fake_mode([v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
        with mode if mode is not None else contextlib.nullcontext():
            node.meta["val"] = target(*vals)
        return node

    def _erase_unused(self, nodes: list[torch.fx.Node]) -> None:
        for node in nodes:
            if node not in self.erased and not node.users:
                self.graph.erase_node(node)
                self.erased.add(node)

    def _left(self, what: str, node: torch.fx.Node, why: str) -> None:
        _LOG.debug("flashoverlap.compile: left %s at %s: %s", what, node.name, why)

    # -- all-gather -> mm ---------------------------------------------------------------------------------------------
    def all_gather(self, wait: torch.fx.Node) -> None:
        gather = wait.args[0]
        shard, world, group = gather.args[0], _arg(gather, 1, "group_size"), _arg(gather, 2, "group_name")
        shard_val, wait_val = _val(shard), _val(wait)
        if shard_val is None or wait_val is None or len(gather.users) != 1:
            return self._left("all_gather_into_tensor", gather, "no shape information, or another reader")
        if shard_val.dtype not in _DTYPES:
            return self._left("all_gather_into_tensor", gather, f"dtype {shard_val.dtype}")
        # The gathered tensor as its readers see it: the wait's result (dimension 0), or DTensor's split + cat along
        # a later dimension, the same bytes when the dimensions before it have size 1.
        result, extra = wait, []
        for user in wait.users:
            if user.target in _SPLITS and len(wait.users) == 1:
                cats = {u for item in user.users for u in item.users}
                if len(cats) == 1:
                    (cat,) = cats
                    found = _split_cat(cat)
                    if found and found[0] is wait and found[1] == 0 and found[3] == world:
                        if not _leading_ones(_val(cat).shape, found[2]):
                            return self._left("all_gather_into_tensor", gather,
                                              f"gathered along dimension {found[2]} with leading dimensions "
                                              f"{list(_val(cat).shape[:found[2]])} (not rows)")
                        result, extra = cat, [user, *user.users]
        result_val = _val(result)
        # Matmuls reading the gathered tensor as rows [M, K] (K its last dimension) through reshapes of it, which
        # keep its bytes in order: it is contiguous.
        candidates, stack = [], [result]
        while stack:
            node = stack.pop()
            for user in node.users:
                if user.target in _VIEWS and user.args[0] is node:
                    stack.append(user)
                elif (user.target is _aten.mm.default and user.args[0] is node) or _bias_addmm(user, node):
                    a_val, b = _val(node), _operands(user)[1]
                    if (a_val is None or _val(b) is None or a_val.shape[-1] != result_val.shape[-1]
                            or shard_val.numel() % a_val.shape[-1] or result in _ancestors(b)):
                        continue
                    candidates.append(user)
        if not candidates:
            return self._left("all_gather_into_tensor", gather, "no matmul reads it as rows")
        mm = max(candidates, key=lambda n: _val(n).shape[-1])  # the widest product hides the most
        a, b = _operands(mm)
        k = _val(a).shape[-1]
        rows = self._call(_aten.reshape.default, (shard, [shard_val.numel() // k, k]), mm)
        fused = self._call(torch.ops.flashoverlap.all_gather_gemm.default, (rows, b, group), mm)
        product = self._call(operator.getitem, (fused, 0), mm)
        if mm.target is _aten.addmm.default:  # addmm(bias, a, b) = a @ b + bias
            product = self._call(_aten.add.Tensor, (product, mm.args[0]), mm)
        gathered = self._call(operator.getitem, (fused, 1), mm)
        gathered_as_result = self._call(_aten.reshape.default, (gathered, list(result_val.shape)), mm)
        mm.replace_all_uses_with(product)
        self._erase_unused([mm])
        result.replace_all_uses_with(gathered_as_result)
        while a.target in _VIEWS and not a.users:  # reshapes that only led to the matmul
            parent = a.args[0]
            self._erase_unused([a])
            a = parent
        self._erase_unused([gathered_as_result, gathered, result, *reversed(extra), wait, gather])
        self._record("all_gather_gemm", f"{gather.name} + {mm.name}", group)

    # -- mm -> reduce-scatter / all-reduce ---------------------------------------------------------------------------
    def _producer(self, what: str, collective: torch.fx.Node, source: torch.fx.Node) -> tuple | None:
        """The matmul whose bytes ``source`` holds (through reshapes; DTensor's split + cat along a dimension
        whose leading dimensions have size 1 for the reduce-scatter), read by nothing else: ``(mm, nodes)``."""
        nodes = []
        found = _split_cat(source) if what == "reduce_scatter_tensor" else None
        if found is not None:
            src, split_dim, cat_dim, pieces = found
            if cat_dim != 0 or pieces != _arg(collective, 2, "group_size"):
                return self._left(what, collective, "a concatenation that is not the scatter's chunking")
            if not _leading_ones(_val(src).shape, split_dim):
                return self._left(what, collective, f"scattered along dimension {split_dim} with leading "
                                  f"dimensions {list(_val(src).shape[:split_dim])} (not rows)")
            split = source.args[0][0].args[0]
            nodes = [source, *source.args[0], split]
            source = src
        node = source
        while node.target in _VIEWS:
            nodes.append(node)
            node = node.args[0]
        if node.target is not _aten.mm.default:
            return self._left(what, collective, f"its input comes from {node.target}, not a matmul")
        nodes.append(node)
        chain = set(nodes) | {collective}
        for member in nodes:
            if any(user not in chain for user in member.users):
                return self._left(what, collective, f"the product is also read by {list(member.users)}")
        val = _val(node)
        if val is None or val.dtype not in _DTYPES:
            return self._left(what, collective, "no shape information, or a dtype the ops do not take")
        return node, nodes

    def reduce_scatter(self, wait: torch.fx.Node) -> None:
        rs = wait.args[0]
        source, op, world, group = rs.args[0], _arg(rs, 1, "reduce_op"), _arg(rs, 2, "group_size"), _arg(
            rs, 3, "group_name")
        if str(op).lower() != "sum" or len(rs.users) != 1:
            return self._left("reduce_scatter_tensor", rs, f"reduce op {op!r} (only sums), or another reader")
        found = self._producer("reduce_scatter_tensor", rs, source)
        if found is None:
            return None
        mm, nodes = found
        if _val(mm).shape[0] % world:
            return self._left("reduce_scatter_tensor", rs, f"{_val(mm).shape[0]} rows do not split over {world}")
        fused = self._call(torch.ops.flashoverlap.gemm_reduce_scatter.default, (mm.args[0], mm.args[1], group), mm)
        out = self._call(_aten.reshape.default, (fused, list(_val(wait).shape)), mm)
        wait.replace_all_uses_with(out)
        self._erase_unused([wait, rs, *nodes])
        self._record("gemm_reduce_scatter", f"{mm.name} + {rs.name}", group)

    def all_reduce(self, wait: torch.fx.Node) -> None:
        ar = wait.args[0]
        source, op, group = ar.args[0], _arg(ar, 1, "reduce_op"), _arg(ar, 2, "group_name")
        if str(op).lower() != "sum" or len(ar.users) != 1:
            return self._left("all_reduce", ar, f"reduce op {op!r} (only sums), or another reader")
        found = self._producer("all_reduce", ar, source)
        if found is None:
            return None
        mm, nodes = found
        fused = self._call(torch.ops.flashoverlap.gemm_all_reduce.default, (mm.args[0], mm.args[1], group), mm)
        out = self._call(_aten.reshape.default, (fused, list(_val(wait).shape)), mm)
        wait.replace_all_uses_with(out)
        self._erase_unused([wait, ar, *nodes])
        self._record("gemm_all_reduce", f"{mm.name} + {ar.name}", group)

    def _record(self, op: str, what: str, group: str) -> None:
        self.changed = True
        _COUNTS[op] += 1
        _LOG.debug("flashoverlap.compile: rewrote %s on group %s into flashoverlap::%s", what, group, op)


def rewrite(graph: torch.fx.Graph) -> dict[str, int]:
    """Rewrite ``graph``'s matmul + collective patterns in place (see the module docstring); returns how many of
    each op it put in. A graph without such patterns is not touched."""
    before = Counter(_COUNTS)
    rewriter = _Rewriter(graph)
    handlers = {_c10d.all_gather_into_tensor.default: rewriter.all_gather,
                _c10d.reduce_scatter_tensor.default: rewriter.reduce_scatter,
                _c10d.all_reduce.default: rewriter.all_reduce}
    for node in list(graph.nodes):
        if node in rewriter.erased or node.target is not _c10d.wait_tensor.default:
            continue
        collective = node.args[0]
        handler = handlers.get(getattr(collective, "target", None))
        if handler is not None and collective not in rewriter.erased:
            handler(node)
    if rewriter.changed:
        # New nodes sit before the matmul they replace; readers of the gathered input placed earlier than it move
        # after it (Inductor sorts again after its custom passes; the pass may also be run on its own).
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
        graph.lint()
    return dict(Counter(_COUNTS) - before)
