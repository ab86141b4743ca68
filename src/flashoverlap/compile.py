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
- ``mm(a, b) -> [reshape] -> all_reduce(sum) -> wait_tensor`` into ``flashoverlap::gemm_all_reduce``;
- fp8, the same with ``aten._scaled_mm`` for the matmul (torchao's float8 models, under torchao's TP styles or written
  by hand): into ``flashoverlap::all_gather_scaled_gemm`` / ``scaled_gemm_reduce_scatter`` /
  ``scaled_gemm_all_reduce`` with the call's scales, ``out_dtype`` and bias, where the op's own checks
  (``runtime.checks.check_scaled``) pass and there is no ``scale_result``; a vector added to the product before the
  reduction (DTensor's row-parallel ``bias / W``) becomes the op's bias. For an all-gather, A's scales must be each
  shard's own: all-gathered beside it in the same group (then the op's gathered scales replace that gather), or shown
  to be the same on every rank (computed only from the group's all-reduces and all-gathers and constants, as
  torchao's amax all-reduce makes them) and one value (tensor-wise, or repeated over the rows). fp8 gathered as its
  bytes (``view.dtype`` to uint8 and back, on backends without fp8) counts as the gather it is. ``use_fast_accum`` is
  taken: the ops accumulate in full precision (a rounding difference, as the fp8 styles of ``nn/float8.py``).

A pattern is rewritten only where the result is exactly the same: a sum; rows gathered or scattered along the
first dimension, or along a later one when every dimension before it has size 1 (``Shard(1)`` of ``[1, S, H]``, as
DTensor sequence parallelism does at batch 1: the same bytes); reshapes that only regroup the rows of a contiguous
tensor; a matmul whose product nothing else reads (a reduction) and whose right operand does not depend on the
gathered input; no empty operand; bf16, fp16 or fp32. Everything else, and every graph without such patterns, is
left as it was (``Shard(1)`` of a batch above 1 among them: DTensor gathers it by split and cat, which the ops' row
layout does not express without copies). The process group is the collective's own: the ops take the same
``group_name``.

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

from flashoverlap.comm.scaled import Scales
from flashoverlap.ops import library  # noqa: F401  (torch.ops.flashoverlap.*)
from flashoverlap.ops import scaled as _scaled_ops  # noqa: F401  (torch.ops.flashoverlap.scaled_*)
from flashoverlap.runtime.checks import DTYPES, FP8_DTYPES, check_scaled

__all__ = ["disable", "enable", "enabled", "is_enabled", "reset_counts", "rewrite", "rewrite_counts"]

_LOG = logging.getLogger("flashoverlap.compile")
_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
_SPLITS = (_aten.split.Tensor, _aten.split_with_sizes.default)
_MATMULS = (_aten.mm.default, _aten._scaled_mm.default)
_REPEATS = (*_VIEWS, _aten.expand.default, _aten.repeat.default, _aten.clone.default, _aten.slice.Tensor)
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
    now on (idempotent; keeps any other post-grad pass registered). Turning the pass on resets ``torch.compile``'s
    caches (``torch._dynamo.reset()``), as turning it off does: compiled code is kept per ``forward`` function, not
    per setting, so a model compiled before would otherwise run its old code, without the pass (or with it, after
    ``disable()``), under a new ``torch.compile`` too. Every compiled model then compiles again at its next call."""
    _switch(True, reset=True)


def disable() -> None:
    """Stop rewriting (resets ``torch.compile``'s caches where the pass was on, as ``enable`` says); other
    post-grad passes stay."""
    _switch(False, reset=True)


def _switch(on: bool, reset: bool) -> None:
    passes = _registered()
    if (_PASS in passes) == on:
        return
    passes = [*passes, _PASS] if on else [p for p in passes if p is not _PASS]
    inductor_config.post_grad_custom_post_pass = (None if not passes else passes[0] if len(passes) == 1
                                                  else passes)
    if reset:
        torch._dynamo.reset()


def is_enabled() -> bool:
    return _PASS in _registered()


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """The pass on for the duration of a ``with`` block (what compiles inside it), then back to how it was, with no
    reset of ``torch.compile``'s caches (unlike ``enable``): code compiled inside the block keeps its rewrites when
    it runs outside it, and code compiled before the block keeps running without them."""
    was = is_enabled()
    _switch(True, reset=False)
    try:
        yield
    finally:
        if not was:
            _switch(False, reset=False)


def rewrite_counts() -> dict[str, int]:
    """How many patterns this process has rewritten, by op (``all_gather_gemm``, ``gemm_reduce_scatter``,
    ``gemm_all_reduce``, ``all_gather_scaled_gemm``, ``scaled_gemm_reduce_scatter``, ``scaled_gemm_all_reduce``)."""
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


def _empty(*vals) -> bool:
    """Whether a tensor among ``vals`` has a dimension of size 0 (the ops take M, N, K >= 1; a symbolic size is never
    0: Dynamo specialises sizes 0 and 1)."""
    return any(isinstance(size, int) and size == 0 for val in vals if val is not None for size in val.shape)


def _operands(mm: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """A matmul's ``(a, b)``, of ``mm(a, b)`` or ``addmm(bias, a, b)``."""
    return (mm.args[1], mm.args[2]) if mm.target is _aten.addmm.default else (mm.args[0], mm.args[1])


def _bitcast_source(node):
    """``node``'s input where ``node`` reinterprets it as another dtype of the same size (``view.dtype``: fp8 moved
    as uint8 bytes, on backends without fp8); ``node`` otherwise."""
    if isinstance(node, torch.fx.Node) and node.target is _aten.view.dtype:
        src, val = node.args[0], _val(node)
        if _val(src) is not None and val is not None and _val(src).dtype.itemsize == val.dtype.itemsize:
            return src
    return node


def _one_value(node, depth: int = 32) -> bool:
    """Whether every element of ``node`` is the same value: one element, or repeats, expansions and reshapes of one,
    through pointwise ops of such (torchao's tensor-wise scale repeated over the rows of a row-wise call)."""
    val = _val(node)
    if val is None or depth == 0:
        return False
    if val.numel() == 1:
        return True
    if node.target in _REPEATS:
        return _one_value(node.args[0], depth - 1)
    if node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return all(_one_value(inp, depth - 1) for inp in node.all_input_nodes)
    return False


def _added_vector(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``add(x, v)`` (either order, ``alpha`` 1) with ``v`` a vector ``[N]`` of ``x``'s last dimension and dtype (a
    bias added after the product, as DTensor adds a row-parallel bias: ``bias / W`` on each rank): ``(x, v)``."""
    if node.target is not _aten.add.Tensor or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    out = _val(node)
    for x, v in (node.args, reversed(node.args)):
        x_val, v_val = _val(x), _val(v)
        if (x_val is not None and v_val is not None and out is not None and v_val.ndim == 1
                and x_val.shape == out.shape and v_val.shape[0] == out.shape[-1]
                and v_val.dtype == out.dtype == x_val.dtype):
            return x, v
    return None


def _scaled_args(mm: torch.fx.Node) -> tuple:
    """``_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)``'s arguments."""
    names = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
    return tuple(_arg(mm, index, name) for index, name in enumerate(names))


def _meta(val: torch.Tensor | None, shape=None) -> torch.Tensor | None:
    """A meta tensor of ``val``'s dtype and shape (or ``shape``): for the ops' checks, which look at no values."""
    if val is None:
        return None
    return torch.empty(val.shape if shape is None else shape, dtype=val.dtype, device="meta")


def _scaled_refusal(op: str, mm: torch.fx.Node, kind: str, a: torch.Tensor | None = None,
                    scale_a: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> str | None:
    """Why ``mm`` (a ``_scaled_mm``) cannot be the fp8 op ``op`` (``kind``: its plan kind), with ``a``, ``scale_a``
    (meta tensors: the shard's, for an all-gather) and ``bias`` in place of its own where given; None where it can: no
    result scale, and the op's own checks (``runtime.checks.check_scaled``: fp8 operands, a scaling mode, bf16 or fp32
    out, a ``[N]`` bias of that dtype) pass on the shapes. ``use_fast_accum`` is taken: the ops accumulate in full
    precision (a rounding difference, as the fp8 styles in ``nn/float8.py`` make it)."""
    own_a, b, own_scale_a, scale_b, own_bias, scale_result, out_dtype, _ = _scaled_args(mm)
    if scale_result is not None:
        return "a result scale (scale_result), which the ops do not take"
    vals = [_meta(_val(n)) for n in (own_a, b, own_scale_a, scale_b)]
    if any(v is None for v in vals) or (own_bias is not None and _val(own_bias) is None):
        return "no shape information"
    bias = bias if bias is not None else _meta(_val(own_bias))
    a_val, b_val, scale_a_val, scale_b_val = vals
    a_val = a if a is not None else a_val
    scale_a_val = scale_a if scale_a is not None else scale_a_val
    out = out_dtype if out_dtype is not None else a_val.dtype  # _scaled_mm's default: the input's dtype
    try:
        check_scaled(op, a_val, b_val, Scales.of(scale_a_val, scale_b_val, out, bias), kind)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


class _Rewriter:
    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.erased: set[torch.fx.Node] = set()
        self.changed = False
        self.uniform: dict[tuple[torch.fx.Node, str], bool] = {}

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
        # fp8 may be gathered as its bytes (``view.dtype`` to uint8 and back, before or after the wait): the same.
        outer = wait.args[0]
        gather = _bitcast_source(outer)
        head = wait
        if len(wait.users) == 1 and _bitcast_source(next(iter(wait.users))) is wait:
            head = next(iter(wait.users))
        shard, world, group = gather.args[0], _arg(gather, 1, "group_size"), _arg(gather, 2, "group_name")
        shard_val, head_val = _val(shard), _val(head)
        if (shard_val is None or head_val is None or len(gather.users) != 1 or len(outer.users) != 1):
            return self._left("all_gather_into_tensor", gather, "no shape information, or another reader")
        source = _bitcast_source(shard)  # a shard sent as its bytes: the tensor before the view
        if shard_val.dtype != head_val.dtype and _val(source) is not None and _val(source).dtype == head_val.dtype:
            shard, shard_val = source, _val(source)
        fp8 = head_val.dtype in FP8_DTYPES
        if shard_val.dtype != head_val.dtype or not (fp8 or shard_val.dtype in _DTYPES):
            return self._left("all_gather_into_tensor", gather, f"dtype {shard_val.dtype} gathered as "
                              f"{head_val.dtype}")
        casts = [node for node in (head, outer) if node is not wait and node is not gather]
        # The gathered tensor as its readers see it: the wait's result (dimension 0), or DTensor's split + cat along
        # a later dimension, the same bytes when the dimensions before it have size 1.
        result, extra = head, []
        for user in head.users:
            if user.target in _SPLITS and len(head.users) == 1:
                cats = {u for item in user.users for u in item.users}
                if len(cats) == 1:
                    (cat,) = cats
                    found = _split_cat(cat)
                    if found and found[0] is head and found[1] == 0 and found[3] == world:
                        if not _leading_ones(_val(cat).shape, found[2]):
                            return self._left("all_gather_into_tensor", gather,
                                              f"gathered along dimension {found[2]} with leading dimensions "
                                              f"{list(_val(cat).shape[:found[2]])} (not rows)")
                        result, extra = cat, [user, *user.users]
        result_val = _val(result)
        # Matmuls reading the gathered tensor as rows [M, K] (K its last dimension) through reshapes of it, which
        # keep its bytes in order: it is contiguous. fp8: ``_scaled_mm`` whose scales of A are the shard's own.
        candidates, refused, stack = [], [], [result]
        while stack:
            node = stack.pop()
            for user in node.users:
                if user.target in _VIEWS and user.args[0] is node:
                    stack.append(user)
                    continue
                if fp8:
                    if user.target is not _aten._scaled_mm.default or user.args[0] is not node:
                        continue
                    inputs = [n for n in _scaled_args(user)[1:5] if isinstance(n, torch.fx.Node)]
                elif (user.target is _aten.mm.default and user.args[0] is node) or _bias_addmm(user, node):
                    inputs = [_operands(user)[1]]
                else:
                    continue
                a_val = _val(node)
                if (a_val is None or any(_val(n) is None for n in inputs) or _empty(a_val, shard_val, _val(user))
                        or a_val.shape[-1] != result_val.shape[-1]
                        or shard_val.numel() % a_val.shape[-1] or any(result in _ancestors(n) for n in inputs)):
                    continue
                if fp8:
                    found = self._shard_scale(user, shard_val.numel() // a_val.shape[-1], world, group)
                    if isinstance(found, str):
                        refused.append(f"{user.name}: {found}")
                        continue
                    user.meta["flashoverlap_scale"] = found
                candidates.append(user)
        if not candidates:
            return self._left("all_gather_into_tensor", gather, "; ".join(refused) or "no matmul reads it as rows")
        mm = max(candidates, key=lambda n: _val(n).shape[-1])  # the widest product hides the most
        a, b = _operands(mm)
        k = _val(a).shape[-1]
        rows = self._call(_aten.reshape.default, (shard, [shard_val.numel() // k, k]), mm)
        scale_wait = None
        if fp8:
            _, _, _, scale_b, bias, _, out_dtype, _ = _scaled_args(mm)
            how, scale = mm.meta.pop("flashoverlap_scale")
            if how == "gathered":  # its own all-gather of the scales, which the op's gathered scales replace
                scale_wait, scale = scale, scale.args[0].args[0]
                scale = self._call(_aten.reshape.default, (scale, [rows.meta["val"].shape[0], -1]), mm)
            elif how == "rows":  # the same rows on every rank and every row the same: any shard's rows are its own
                scale = self._call(_aten.slice.Tensor, (scale, 0, 0, rows.meta["val"].shape[0]), mm)
            op, name = torch.ops.flashoverlap.all_gather_scaled_gemm.default, "all_gather_scaled_gemm"
            args = (rows, b, scale, scale_b, group, out_dtype, bias, "auto")
        else:
            op, name = torch.ops.flashoverlap.all_gather_gemm.default, "all_gather_gemm"
            args = (rows, b, group)
        for other in candidates:
            other.meta.pop("flashoverlap_scale", None)
        fused = self._call(op, args, mm)
        product = self._call(operator.getitem, (fused, 0), mm)
        if mm.target is _aten.addmm.default:  # addmm(bias, a, b) = a @ b + bias
            product = self._call(_aten.add.Tensor, (product, mm.args[0]), mm)
        gathered = self._call(operator.getitem, (fused, 1), mm)
        gathered_as_result = self._call(_aten.reshape.default, (gathered, list(result_val.shape)), mm)
        if scale_wait is not None:
            scales = self._call(operator.getitem, (fused, 2), mm)
            scale_wait.replace_all_uses_with(self._call(_aten.reshape.default, (scales, list(
                _val(scale_wait).shape)), mm))
        mm.replace_all_uses_with(product)
        self._erase_unused([mm])
        result.replace_all_uses_with(gathered_as_result)
        if scale_wait is not None:
            self._erase_unused([scale_wait, scale_wait.args[0]])
        while a.target in _VIEWS and not a.users:  # reshapes that only led to the matmul
            parent = a.args[0]
            self._erase_unused([a])
            a = parent
        self._erase_unused([gathered_as_result, gathered, result, *reversed(extra), *casts, wait, gather])
        self._record(name, f"{gather.name} + {mm.name}", group)

    def _shard_scale(self, mm: torch.fx.Node, rows: int, world: int, group: str) -> tuple | str:
        """How the op gets each shard's own scales of A for ``mm`` (a ``_scaled_mm`` of the gathered rows, ``rows``
        of them a shard), or why it cannot: ``("gathered", wait)``: they are all-gathered too, in the same group
        (``wait`` its result, ``[M, S]`` or ``[M]``); ``("same", scale)``: one value, the same on every rank;
        ``("rows", scale)``: ``[M, 1]``, the same on every rank and in every row. Then the op's checks must pass."""
        _, b, scale_a, scale_b, bias = _scaled_args(mm)[:5]
        node = scale_a
        while node.target in _VIEWS:
            node = node.args[0]
        scale_val, how, shard_scale = _val(scale_a), None, None
        if scale_val is None:
            return "no shape information"
        source = node.args[0] if node.target is _c10d.wait_tensor.default else None
        if source is not None and source.target is _c10d.all_gather_into_tensor.default:
            node_val, shard_val = _val(node), _val(source.args[0])
            readers = [n for n in (b, scale_b, bias) if isinstance(n, torch.fx.Node)]
            if (_arg(source, 2, "group_name") == group and _arg(source, 1, "group_size") == world
                    and len(source.users) == 1 and node_val is not None and shard_val is not None
                    and node_val.ndim in (1, 2) and node_val.shape[0] == rows * world and scale_val.ndim == 2
                    and scale_val.shape[0] == rows * world and not any(node in _ancestors(n) for n in readers)):
                how, shard_scale = ("gathered", node), _meta(shard_val, (rows, shard_val.numel() // rows))
        if how is None and self._uniform(scale_a, group):
            if scale_val.numel() == 1:
                how, shard_scale = ("same", scale_a), _meta(scale_val)
            elif tuple(scale_val.shape) == (rows * world, 1) and _one_value(scale_a):
                how, shard_scale = ("rows", scale_a), _meta(scale_val, (rows, 1))
        if how is None:
            return ("A's scales are neither all-gathered with it nor shown to be the same for every shard (one "
                    "value on every rank of the group)")
        a_val = _val(mm.args[0])
        refusal = _scaled_refusal("all_gather_scaled_gemm", mm, "all_gather", _meta(a_val, (rows, a_val.shape[-1])),
                                  shard_scale)
        return how if refusal is None else refusal

    def _uniform(self, node: torch.fx.Node, group: str) -> bool:
        """Whether ``node`` holds the same value on every rank of ``group``: everything it is computed from is the
        result of an all-reduce or all-gather over the group, or a constant the graph makes (no input, no random
        numbers), through ops that depend on nothing else (a placeholder may differ from rank to rank)."""
        found = self.uniform.get((node, group))
        if found is not None:
            return found
        seen, stack, found = {node}, [node], True
        while stack and found:
            current = stack.pop()
            if current.target is _c10d.wait_tensor.default:
                source = _bitcast_source(current.args[0])
                found = (source.target in (_c10d.all_reduce.default, _c10d.all_gather_into_tensor.default)
                         and _arg(source, 2, "group_name") == group)  # the group's name: argument 2 of both
                continue
            target = current.target
            if (current.op != "call_function" or getattr(target, "namespace", None) in ("_c10d_functional", "c10d")
                    or torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())):
                found = False
                continue
            for inp in current.all_input_nodes:
                if inp not in seen:
                    seen.add(inp)
                    stack.append(inp)
        self.uniform[(node, group)] = found
        return found

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
        node, bias = source, None
        while node.target in _VIEWS:
            nodes.append(node)
            node = node.args[0]
        added = _added_vector(node)
        if added is not None:  # an fp8 product plus a vector of its last dimension: _scaled_mm's bias
            nodes.append(node)
            node, bias = added
            while node.target in _VIEWS:
                nodes.append(node)
                node = node.args[0]
            if node.target is not _aten._scaled_mm.default or _scaled_args(node)[4] is not None:
                return self._left(what, collective, f"its input is a sum of {node.target} and a vector, not of an fp8 "
                                  "matmul without a bias")
        if node.target not in _MATMULS:
            return self._left(what, collective, f"its input comes from {node.target}, not a matmul")
        nodes.append(node)
        chain = set(nodes) | {collective}
        for member in nodes:
            if any(user not in chain for user in member.users):
                return self._left(what, collective, f"the product is also read by {list(member.users)}")
        val = _val(node)
        if node.target is _aten._scaled_mm.default:
            op = "scaled_gemm_reduce_scatter" if what == "reduce_scatter_tensor" else "scaled_gemm_all_reduce"
            refusal = _scaled_refusal(op, node, "reduce_scatter" if what == "reduce_scatter_tensor" else "all_reduce",
                                      bias=_meta(_val(bias)))
            if refusal is not None:
                return self._left(what, collective, refusal)
        elif val is None or val.dtype not in _DTYPES:
            return self._left(what, collective, "no shape information, or a dtype the ops do not take")
        return node, nodes, bias

    def _fused(self, kind: str, mm: torch.fx.Node, group: str, added=None) -> tuple[torch.fx.Node, str]:
        """The op (``kind``: ``reduce_scatter`` or ``all_reduce``) in place of ``mm`` and its collective, inserted
        before ``mm`` (fp8: with ``added`` as its bias where the graph adds it to the product); and its name."""
        if mm.target is _aten._scaled_mm.default:
            name = f"scaled_gemm_{kind}"
            a, b, scale_a, scale_b, bias, _, out_dtype, _ = _scaled_args(mm)
            bias = bias if added is None else added
            args = (a, b, scale_a, scale_b, group, out_dtype, bias, "auto")
        else:
            name, args = f"gemm_{kind}", (mm.args[0], mm.args[1], group)
        return self._call(getattr(torch.ops.flashoverlap, name).default, args, mm), name

    def reduce_scatter(self, wait: torch.fx.Node) -> None:
        rs = wait.args[0]
        source, op, world, group = rs.args[0], _arg(rs, 1, "reduce_op"), _arg(rs, 2, "group_size"), _arg(
            rs, 3, "group_name")
        if str(op).lower() != "sum" or len(rs.users) != 1:
            return self._left("reduce_scatter_tensor", rs, f"reduce op {op!r} (only sums), or another reader")
        found = self._producer("reduce_scatter_tensor", rs, source)
        if found is None:
            return None
        mm, nodes, bias = found
        if _empty(_val(mm), *map(_val, _operands(mm))):
            return self._left("reduce_scatter_tensor", rs, "an empty operand (the op takes M, N, K >= 1)")
        if _val(mm).shape[0] % world:
            return self._left("reduce_scatter_tensor", rs, f"{_val(mm).shape[0]} rows do not split over {world}")
        fused, name = self._fused("reduce_scatter", mm, group, bias)
        out = self._call(_aten.reshape.default, (fused, list(_val(wait).shape)), mm)
        wait.replace_all_uses_with(out)
        self._erase_unused([wait, rs, *nodes])
        self._record(name, f"{mm.name} + {rs.name}", group)

    def all_reduce(self, wait: torch.fx.Node) -> None:
        ar = wait.args[0]
        source, op, group = ar.args[0], _arg(ar, 1, "reduce_op"), _arg(ar, 2, "group_name")
        if str(op).lower() != "sum" or len(ar.users) != 1:
            return self._left("all_reduce", ar, f"reduce op {op!r} (only sums), or another reader")
        found = self._producer("all_reduce", ar, source)
        if found is None:
            return None
        mm, nodes, bias = found
        if _empty(_val(mm), *map(_val, _operands(mm))):
            return self._left("all_reduce", ar, "an empty operand (the op takes M, N, K >= 1)")
        fused, name = self._fused("all_reduce", mm, group, bias)
        out = self._call(_aten.reshape.default, (fused, list(_val(wait).shape)), mm)
        wait.replace_all_uses_with(out)
        self._erase_unused([wait, ar, *nodes])
        self._record(name, f"{mm.name} + {ar.name}", group)

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
        collective = _bitcast_source(node.args[0])  # fp8 gathered as bytes: the wait may read a view of it
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
