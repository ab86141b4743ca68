"""PyTorch tensor-parallel styles whose sharded ``nn.Linear`` runs flashoverlap's ops: ``ColwiseParallel`` and
``RowwiseParallel`` for ``torch.distributed.tensor.parallel.parallelize_module``, and ``styles_from_hf_plan`` (with
``ReplicatedWithGradAllReduce`` for the replicated norms of a Hugging Face plan).

They are drop-in replacements for PyTorch's styles of the same names (subclasses of them, so of ``ParallelStyle``):
the same arguments (``input_layouts``, ``output_layouts``, ``use_local_output``), the same parameter sharding
(weights and biases become DTensors exactly as PyTorch's styles make them, so FSDP2's ``fully_shard`` composes on a
2-D mesh), the same input and output layouts. Only the sharded linear's forward and backward differ: they run on
the local shards (``DTensor.to_local()``) through ``torch.ops.flashoverlap.*``, with the group of the 1-D mesh
(``mesh.get_group()``). ``W`` ranks, rank r, ``x [B, S, K]`` (any leading dimensions; tokens become rows):

- colwise, input ``Shard(d)``, d not the last (sequence parallelism): ``x_r [B, S/W, K] -> y_r [B, S, N/W]`` by
  ``all_gather_gemm`` (backward: ``gemm_reduce_scatter``);
- colwise, input a plain tensor annotated ``Replicate`` (the default): ``x [B, S, K] -> y_r [B, S, N/W]`` by
  ``linear_column`` (backward: ``gemm_all_reduce``);
- rowwise, output ``Shard(d)``, d not the last (sequence parallelism): ``x_r [B, S, K/W] -> y_r [B, S/W, N]`` by
  ``gemm_reduce_scatter`` (backward: ``all_gather_gemm``);
- rowwise, output ``Replicate`` (the default): ``x_r [B, S, K/W] -> y [B, S, N]`` by ``gemm_all_reduce``
  (backward: local).

The ops gather and scatter rows (dimension 0 of ``[M, K]``). Sharding dimension ``d`` of ``x`` is the same as
sharding rows when every dimension before ``d`` has size 1 (``B == 1`` for ``Shard(1)`` on ``[B, S, H]``, as in
prefill), and then it costs nothing; otherwise the shard is moved sequence-major first (``movedim(d, 0)``, one copy
of this rank's shard) and the result moved back (one copy of the output), which is exact for any ``B``.

Everything else is PyTorch's own behaviour, unchanged:

- a colwise linear with the default ``input_layouts`` given a *DTensor* already ``Replicate`` (what
  ``PrepareModuleInput(desired_input_layouts=Replicate())`` hands it, as in torchtitan's plan) multiplies its shard
  locally and hands back a ``Partial`` gradient, as PyTorch's style does: the all-gather and the gradient's
  reduce-scatter are ``PrepareModuleInput``'s, shared by the projections it feeds (under other ``input_layouts``
  PyTorch's style redistributes it, which reduces the gradient: its path runs);
- the output's redistribution to ``output_layouts`` when it is not the op's own (colwise ``output_layouts=
  Replicate()``) is PyTorch's ``_prepare_output_fn``;
- any layout combination that is not one of the four above (colwise input ``Shard(-1)`` or ``Partial``, rowwise
  input not sharded on the last dimension, rowwise output ``Shard(-1)`` or ``Partial``), an ``nn.Embedding``, an
  ``nn.Linear`` subclass with a forward of its own (torchao's ``Float8Linear``: the fp8 styles are ``nn/float8``'s),
  a shard that does not divide (a sharded axis of the input or output, or the weight's sharded width), a dtype the
  ops do not take (they take bf16, fp16, fp32), or autocast: the linear runs exactly as PyTorch's style runs it
  (DTensor ``F.linear`` between PyTorch's input and output hooks; on the reference path and in debug mode, after
  the ranks agree on the branch each input took: ``runtime/calls.agree_on_branch``). Styles whose
  layouts are known not to apply at ``parallelize_module`` time are PyTorch's styles outright.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.parallel import style as torch_styles
from torch.distributed.tensor.placement_types import Placement

from flashoverlap.ops import library  # noqa: F401  (torch.ops.flashoverlap.*)
from flashoverlap.runtime.calls import agree_on_branch
from flashoverlap.runtime.checks import DTYPES
from flashoverlap.runtime.policy import check_path_name

_LOG = logging.getLogger("flashoverlap.nn.styles")
_DTYPES = DTYPES  # the ops' one dtype rule (runtime/checks.py)
_BOUND = "_flashoverlap_binding"  # the attribute holding a linear's style, mesh and group


class _Binding:
    """What a sharded linear's forward needs, fixed at ``parallelize_module`` time (plain attributes, so that
    ``torch.compile`` reads them as constants)."""

    def __init__(self, style: ColwiseParallel | RowwiseParallel, mesh: DeviceMesh) -> None:
        if mesh.ndim != 1:
            raise ValueError(f"{type(style).__name__}: the device mesh must be 1-D (the tensor-parallel dimension), "
                             f"got a {mesh.ndim}-D mesh; pass mesh['tp'] to parallelize_module")
        self.style, self.mesh = style, mesh
        group = mesh.get_group()
        self.group, self.world = group.group_name, mesh.size()


def _forward(self: nn.Linear, input: torch.Tensor) -> Any:
    binding: _Binding = getattr(self, _BOUND)
    return binding.style._linear_forward(self, input, binding)


_CLASSES: dict[type, type] = {}


def _bind(module: nn.Linear, binding: _Binding) -> None:
    """Route ``module``'s forward to its style: its class becomes a subclass of its own class with that forward (as
    FSDP2's ``fully_shard`` does), so ``isinstance(module, nn.Linear)`` and the state dict are unchanged."""
    cls = own_class(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FlashOverlap{cls.__name__}", (cls,),
                             {"forward": _forward, "_flashoverlap_routed": True, "__module__": __name__})
    module.__class__ = _CLASSES[cls]
    setattr(module, _BOUND, binding)


def own_class(module: nn.Module) -> type:
    """``module``'s own class, below flashoverlap's routing where the module is routed (the routed class declares
    ``_flashoverlap_routed``; FSDP2's ``fully_shard`` may put its own class before it)."""
    for cls in type(module).__mro__:
        if "_flashoverlap_routed" in vars(cls):
            return cls.__mro__[1]
    return type(module)


def own_forward(module: nn.Module) -> Any:
    """``module``'s own class's ``forward`` (``own_class``)."""
    return own_class(module).forward


def _normalize(placement: Placement, ndim: int) -> Placement:
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def _input_layout(x: torch.Tensor, annotated: Placement, mesh: DeviceMesh) -> tuple[Placement | None, torch.Tensor]:
    """The input's layout (a DTensor's own, else the annotated one) and its local tensor; ``None`` where the input
    is a DTensor on another mesh (left to PyTorch)."""
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            return None, x
        return _normalize(x.placements[0], x.ndim), x
    return _normalize(annotated, x.ndim), x


def _runs_our_ops(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the ops can take this call (else PyTorch's path): their dtypes, at least one row, no autocast
    (which would cast a linear's operands; the ops run in their inputs' dtype)."""
    return (x.dtype in _DTYPES and x.dtype == weight.dtype and x.ndim >= 2 and x.numel() > 0
            and not torch.is_autocast_enabled(x.device.type))


def _rows_major(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with dimension ``dim`` outermost, as rows ``[-1, x.shape[-1]]`` (a view when the dimensions before it
    have size 1)."""
    if any(size != 1 for size in x.shape[:dim]):
        x = x.movedim(dim, 0)
    return x.reshape(-1, x.shape[-1])


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """The inverse of ``_rows_major`` for an output whose dimension ``dim`` now has ``size`` and whose last has
    ``rows.shape[-1]``: ``like``'s other dimensions, contiguous as ``F.linear``'s output is."""
    shape = list(like.shape)
    shape[dim], shape[-1] = size, rows.shape[-1]
    if all(s == 1 for s in like.shape[:dim]):
        return rows.view(shape)
    moved = [shape[dim], *shape[:dim], *shape[dim + 1:]]
    return rows.view(moved).movedim(0, dim).contiguous()


class _OverlappedLinear:
    """What both styles add to PyTorch's: the ops' ``path``, a linear's forward routed to the style once its
    parameters are distributed as PyTorch's style distributes them, and PyTorch's own forward for the cases our ops
    do not take."""

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, path: str = "auto") -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.path = check_path_name(type(self).__name__, path)

    def _reproduces(self, module: nn.Module) -> bool:
        """Whether this style's forward computes what ``module``'s own does: ``nn.Linear``'s. A subclass with a
        forward of its own (torchao's ``Float8Linear`` among them) runs as PyTorch's style runs it, said once."""
        if own_forward(module) is nn.Linear.forward:
            return True
        _LOG.info("%s: %s has a forward of its own: PyTorch's style runs it", type(self).__name__,
                  type(module).__name__)
        return False

    def _route(self, module: nn.Linear, device_mesh: DeviceMesh) -> nn.Module:
        binding = _Binding(self, device_mesh)
        distribute_module(module, device_mesh, self._partition_linear_fn)
        _bind(module, binding)
        return module

    # The weight's dimension the style shards (ColwiseParallel: N, RowwiseParallel: K).
    _sharded_dim = 0

    def _uneven(self, module: nn.Linear, binding: _Binding) -> bool:
        """Whether the weight's sharded width does not divide by the group's size: DTensor's shards then differ in
        size from rank to rank, which the ops' agreement refuses; PyTorch's style runs such a linear."""
        return module.weight.shape[self._sharded_dim] % binding.world != 0

    def _fallback(self, module: nn.Linear, x: torch.Tensor, binding: _Binding) -> Any:
        """PyTorch's path (``_torch_forward``) for a call the ops do not take, once the ranks agree that each takes
        it where they agree on every call (``_agree_on_branch``)."""
        self._agree_on_branch(x, binding, True)
        return self._torch_forward(module, x, binding)

    def _agree_on_branch(self, x: torch.Tensor, binding: _Binding, fallback: bool) -> None:
        """``calls.agree_on_branch`` for a forward with no exchange of its own (not while compiling: the exchange
        is the eager reference path's net)."""
        if not torch.compiler.is_compiling():
            agree_on_branch(type(self).__name__, x, binding.mesh.get_group(), self.path, fallback)

    def _torch_forward(self, module: nn.Linear, x: torch.Tensor, binding: _Binding) -> Any:
        """Exactly what PyTorch's style runs: its input hook, DTensor ``F.linear``, its output hook."""
        x = self._prepare_input_fn(self.input_layouts, self.desired_input_layouts, module, (x,), binding.mesh)
        y = F.linear(x, module.weight, module.bias)
        return self._prepare_output_fn(self.output_layouts, self.use_local_output, module, y, binding.mesh)


class ColwiseParallel(_OverlappedLinear, torch_styles.ColwiseParallel):
    """PyTorch's ``ColwiseParallel`` (same arguments, same layouts, same DTensor parameters: ``weight`` and
    ``bias`` ``Shard(0)``) whose ``nn.Linear`` runs ``all_gather_gemm`` when its input is sharded on a dimension
    other than the last (sequence parallelism: ``input_layouts=Shard(1)``), and ``linear_column`` (backward by
    ``gemm_all_reduce``) when its input is a plain tensor annotated ``Replicate`` (the default). Other cases run as
    PyTorch runs them: see the module docstring. ``path`` is the ops' path (``"auto"``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.input_layouts[0]
        if (not isinstance(module, nn.Linear) or isinstance(layout, Partial) or layout == Shard(-1)
                or not self._reproduces(module)):
            return super()._apply(module, device_mesh)  # PyTorch's style outright
        return self._route(module, device_mesh)

    def _linear_forward(self, module: nn.Linear, x: torch.Tensor, binding: _Binding) -> Any:
        layout, local = _input_layout(x, self.input_layouts[0], binding.mesh)
        weight = module.weight.to_local()  # [N/W, K]
        if layout is None or not _runs_our_ops(local, weight) or self._uneven(module, binding):
            return self._fallback(module, x, binding)
        if isinstance(layout, Replicate) and isinstance(x, DTensor) and not isinstance(self.input_layouts[0],
                                                                                     Replicate):
            # PyTorch's style redistributes x from its annotated layout to Replicate, a no-op whose backward
            # reduces x's gradient (Replicate, not Partial): its path, as it runs it.
            return self._torch_forward(module, x, binding)
        if isinstance(layout, Replicate) and isinstance(x, DTensor):
            # PyTorch's computation, without DTensor dispatch: x is whole here, and its gradient is a partial sum
            # that whoever made x reduces (PrepareModuleInput's reduce-scatter, once for every projection it fed).
            y = F.linear(x.to_local(grad_placements=[Partial()]), weight)
        elif isinstance(layout, Replicate):
            self._agree_on_branch(local, binding, False)  # linear_column's forward exchanges nothing
            y_rows = torch.ops.flashoverlap.linear_column(local.reshape(-1, local.shape[-1]), weight, binding.group,
                                                          self.path)
            y = y_rows.view(*local.shape[:-1], y_rows.shape[-1])
        elif isinstance(layout, Shard) and layout.dim < local.ndim - 1 and (
                not isinstance(x, DTensor) or x.shape[layout.dim] % binding.world == 0):
            if isinstance(x, DTensor):
                local = x.to_local()
            y_rows, _ = torch.ops.flashoverlap.all_gather_gemm(_rows_major(local, layout.dim), weight.t(),
                                                               binding.group, self.path)
            y = _from_rows(y_rows, local, layout.dim, local.shape[layout.dim] * binding.world)
        else:
            return self._fallback(module, x, binding)
        if module.bias is not None:
            y = y + module.bias.to_local()
        if self.use_local_output and _normalize(self.output_layouts[0], y.ndim) == Shard(y.ndim - 1):
            return y
        y = DTensor.from_local(y, binding.mesh, [Shard(y.ndim - 1)], run_check=False)
        return self._prepare_output_fn(self.output_layouts, self.use_local_output, module, y, binding.mesh)


class RowwiseParallel(_OverlappedLinear, torch_styles.RowwiseParallel):
    """PyTorch's ``RowwiseParallel`` (same arguments, same layouts, same DTensor parameters: ``weight``
    ``Shard(1)``, ``bias`` ``Replicate``) whose ``nn.Linear`` runs ``gemm_reduce_scatter`` when its output is
    sharded on a dimension other than the last (sequence parallelism: ``output_layouts=Shard(1)``), and
    ``gemm_all_reduce`` when it is ``Replicate`` (the default). Its input must be sharded on the last dimension (the
    default ``input_layouts``); other cases run as PyTorch runs them: see the module docstring. ``path`` is the ops'
    path (``"auto"``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        inp, out = self.input_layouts[0], self.output_layouts[0]
        if (not isinstance(module, nn.Linear) or not isinstance(inp, Shard) or not isinstance(out, (Replicate, Shard))
                or out == Shard(-1) or not self._reproduces(module)):
            return super()._apply(module, device_mesh)  # PyTorch's style outright
        self.desired_input_layouts = (Shard(-1),)  # what PyTorch's _apply sets for a linear
        return self._route(module, device_mesh)

    # Whether our ops take this input and weight (else PyTorch's style runs the module).
    _runs = staticmethod(_runs_our_ops)
    _sharded_dim = 1

    def _product(self, rows: torch.Tensor, weight: torch.Tensor, module: nn.Module, binding: _Binding,
                 sequence: bool) -> torch.Tensor:
        """``rows [M, K/W] @ weight.t()`` summed over the group: reduce-scattered by rows (``sequence``) or
        all-reduced."""
        op = torch.ops.flashoverlap.gemm_reduce_scatter if sequence else torch.ops.flashoverlap.gemm_all_reduce
        return op(rows, weight.t(), binding.group, self.path)

    def _linear_forward(self, module: nn.Linear, x: torch.Tensor, binding: _Binding) -> Any:
        layout, local = _input_layout(x, self.input_layouts[0], binding.mesh)
        weight = module.weight.to_local()  # [N, K/W]
        if (layout is None or not self._runs(local, weight) or layout != Shard(local.ndim - 1)
                or self._uneven(module, binding)):
            return self._fallback(module, x, binding)
        if isinstance(x, DTensor):
            local = x.to_local()
        out = _normalize(self.output_layouts[0], local.ndim)
        bias = module.bias
        if isinstance(out, Replicate):
            y_rows = self._product(local.reshape(-1, local.shape[-1]), weight, module, binding, False)
            y = y_rows.view(*local.shape[:-1], y_rows.shape[-1])
            # Every rank holds the whole gradient of y, so each computes the bias's whole gradient.
            bias = bias.to_local() if bias is not None else None
        elif isinstance(out, Shard) and out.dim < local.ndim - 1 and local.shape[out.dim] % binding.world == 0:
            y_rows = self._product(_rows_major(local, out.dim), weight, module, binding, True)
            y = _from_rows(y_rows, local, out.dim, local.shape[out.dim] // binding.world)
            if bias is not None:
                # Each rank's bias gradient covers its own tokens: summed over the group (the no-op redistribute's
                # backward turns the Partial gradient into a Replicate one), as PyTorch's style ends up with.
                bias = bias.redistribute(binding.mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        else:
            return self._fallback(module, x, binding)
        if bias is not None:
            y = y + bias.to(y.dtype)
        if self.use_local_output:
            return y
        return DTensor.from_local(y, binding.mesh, [out], run_check=False)


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module whose parameters stay whole on every rank while it sees only this rank's part of a sharded axis:
    Qwen3's per-head ``q_norm`` and ``k_norm`` between the colwise q/k projections and the rowwise o projection
    (Hugging Face's plan string ``replicated_with_grad_allreduce``). The forward is untouched; each rank's gradient
    of a parameter covers only its own heads, so it is summed over the mesh's group as it arrives, before it is
    accumulated into ``.grad`` (micro-batches then accumulate sums, never sums of sums). The hooks are attached at
    the module's first forward, so that parameters replaced after ``parallelize_module`` (loaded weights) get them.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        # Each parameter object hooked once, whatever its name's history (by id: a tensor's == is elementwise; the
        # entry goes with the parameter, so a later one at the same id is hooked).
        hooked: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

        def summed(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()  # the incoming gradient may be another tensor's too
            torch.distributed.all_reduce(grad, group=group)
            return grad

        def hook_parameters(module: nn.Module, args: Any) -> None:
            for param in module.parameters(recurse=False):
                if param.requires_grad and hooked.get(id(param)) is not param:
                    param.register_hook(summed)
                    hooked[id(param)] = param

        module.register_forward_pre_hook(hook_parameters)
        return module


# Hugging Face's tensor-parallel plan strings (``config.base_model_tp_plan``) that name a sharded linear (or a
# replicated module with partial gradients), and the style with the same layouts (transformers' own registry:
# ``transformers.distributed.tensor_parallel``).
_HF_STYLES = {
    "colwise": lambda path: ColwiseParallel(path=path),
    "rowwise": lambda path: RowwiseParallel(path=path),
    "colwise_rep": lambda path: ColwiseParallel(output_layouts=Replicate(), path=path),
    "colwise_gather_output": lambda path: ColwiseParallel(output_layouts=Replicate(), path=path),
    "rowwise_rep": lambda path: RowwiseParallel(input_layouts=Replicate(), path=path),
    "rowwise_split_input": lambda path: RowwiseParallel(input_layouts=Replicate(), path=path),
    "replicated_with_grad_allreduce": lambda path: ReplicatedWithGradAllReduce(),
}


def styles_from_hf_plan(plan: dict[str, str], prefix: str = "", path: str = "auto") -> dict[str, ParallelStyle]:
    """A ``parallelize_module`` plan from a Hugging Face ``tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise",
    ...}``, as in ``config.base_model_tp_plan``): each name prefixed with ``prefix`` (``"model."`` for a
    ``LlamaForCausalLM``, whose base model is ``model``), each style string mapped to the style with the same
    layouts. Raises naming the strings it does not map (packed, MoE and embedding styles), before anything is
    sharded: leave those entries out of ``plan`` and shard their modules apart (PyTorch's styles where one has the
    same layouts; transformers' own are not ``ParallelStyle``s), or keep transformers' whole plan for the model."""
    # (by their reprs: the values may be of any type, None and strings mixed, or unhashable)
    unknown = sorted({repr(style) for style in plan.values() if not (isinstance(style, str) and style in _HF_STYLES)})
    if unknown:
        raise ValueError(f"styles_from_hf_plan: no flashoverlap style for {', '.join(unknown)}; mapped are "
                         f"{sorted(_HF_STYLES)}. "
                         "Leave those entries out of the plan and shard their modules apart (PyTorch's styles where "
                         "one has the same layouts), or keep transformers' own plan for this model")
    return {prefix + name: _HF_STYLES[style](path) for name, style in plan.items()}
