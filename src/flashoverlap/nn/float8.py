"""torchao float8 training under tensor parallelism, overlapped: ``Float8ColwiseParallel``, ``Float8RowwiseParallel``
and ``PrepareFloat8ModuleInput``, drop-ins for ``torchao.float8.float8_tensor_parallel``'s styles of the same names
and arguments, for ``parallelize_module`` on modules converted by ``torchao.float8.convert_to_float8_training``.

They shard parameters as torchao's styles do (PyTorch's layouts: colwise ``weight`` ``Shard(0)``, rowwise ``Shard(1)``)
and run the sharded ``Float8Linear`` through flashoverlap's fp8 ops, with the casts ``Float8Linear`` makes for the
module's config (tensorwise and rowwise recipes alike). ``W`` ranks, ``x_r`` rank r's input as rows ``[M_r, K_r]``
(leading dimensions flattened; a sequence dimension moved first where the batch is over 1, as in ``styles.py``):

- colwise, input ``Shard(1)`` (sequence parallelism): ``y_r [M, N/W] = all_gather(fp8(x_r)) @ fp8(w_r).t()`` by
  ``all_gather_scaled_gemm`` (fp8 rows and their scales on the wire); backward ``dx_r [M/W, K]`` by
  ``scaled_gemm_reduce_scatter(fp8(dy_r), fp8(w_r))``, ``dw_r [N/W, K] = fp8(dy_r).t() @ fp8(x)`` locally;
- colwise, input a plain tensor annotated ``Replicate``: ``y_r`` by a local scaled matmul; backward ``dx`` by
  ``scaled_gemm_all_reduce``;
- rowwise, output ``Shard(1)``: ``y_r [M/W, N]`` by ``scaled_gemm_reduce_scatter(fp8(x_r), fp8(w_r).t())``; backward
  ``dx_r [M, K/W] = all_gather(fp8(dy_r)) @ fp8(w_r)`` by ``all_gather_scaled_gemm``, ``dw_r`` locally;
- rowwise, output ``Replicate``: ``y`` by ``scaled_gemm_all_reduce``; backward local.

The casts are ``Float8Linear``'s (``matmul_with_hp_or_float8_args``): for each of the three GEMMs the operand's
``CastConfig`` (dtype, tensor-wise or axis-wise along the contracted dimension, power-of-2 scales), computed with
torchao's own ``tensor_to_scale`` and ``to_fp8_saturated``, so the scales are torchao's. A scale whose extent is split
over the ranks takes the group's amax (all-reduce MAX of the local amaxes, torchao's ``reduce_amax``): the scales
equal those of the unsharded model, as DTensor gives them to torchao's own styles. Where a cast is the same for two
GEMMs (tensor-wise), the fp8 tensor is reused: the forward's gathered fp8 input feeds the colwise weight gradient, the
backward's gathered fp8 gradient the rowwise one. Axis-wise (rowwise recipe) weight gradients contract over the
tokens, which the other operand holds sharded under sequence parallelism: that operand is cast with the group's
column amax and all-gathered in fp8 (``M x K`` bytes, not overlapped: no overlapped op contracts a gathered
dimension).

Two numerical differences from torchao, both by the ops: they have no ``use_fast_accum`` (cuBLAS's full-precision
accumulation on every GEMM; torchao's forward GEMM uses fast accumulation), and a row-wise product's scales are
applied before the output is rounded (torchao's non-fast-accum row-wise GEMMs round, then scale; equal where the
scales are powers of 2, as the rowwise recipe makes them). The output dtype follows torchao's rule: the module's
dtype, through bf16 for row-wise scaling and through fp32 for fp16.

torchao's own styles are not the unsharded ``Float8Linear``: they cast the input and the output gradient tensor-wise
whatever the recipe (in their hooks, before ``Float8Linear`` sees them), and take the bias gradient from the fp8
output gradient. These styles keep the unsharded model's casts, so they are closer to it (the tests' figures: row-wise
recipe, output 2.4e-3 against torchao's styles' 5.2e-2; weight gradients bit-equal to the unsharded model's).

Everything else is torchao's styles' own behaviour (their hooks, ``Float8Linear.forward`` on DTensors): an input
already cast to fp8 (``PrepareFloat8ModuleInput``'s, a ``Replicate`` DTensor shared by several projections), other
layouts (as ``styles.py`` lists them), autocast, an input dtype other than the weight's, a config these styles do not
run (a cast ``DISABLED``, ``emulate``, ``pad_inner_dim``, FSDP float8 all-gather), a shard that does not divide.
``PrepareFloat8ModuleInput`` is torchao's: it casts once and all-gathers fp8 for the projections that share it.

torchao is an optional dependency (``pip install "torchao>=0.10"``, or the ``fp8`` extra of a source checkout:
``pip install -e ".[fp8]"``), imported when a style is constructed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput
from torch.distributed.tensor.parallel import style as torch_styles

from flashoverlap.comm.scaled import Scales
from flashoverlap.nn import styles
from flashoverlap.nn.styles import _Binding, _from_rows, _input_layout, _normalize, _rows_major
from flashoverlap.ops import scaled as scaled_ops
from flashoverlap.runtime.checks import DTYPES, FP8_DTYPES

# flashoverlap is installed from a source checkout (the package index does not serve it): torchao alone, or the extra.
_INSTALL = 'pip install "torchao>=0.10" (or, in a source checkout, pip install -e ".[fp8]")'
_TORCHAO_STYLES = "torchao.float8.float8_tensor_parallel"


def _torchao(what: str) -> None:
    """Raise, saying how to install it, where torchao's float8 is missing."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        raise ImportError(f"{what} needs torchao's float8 training (torchao>=0.10): {_INSTALL}") from error


# -- the recipe: Float8Linear's casts and GEMM settings --------------------------------------------------------------


@dataclass(frozen=True)
class _Cast:
    """One operand's cast for one GEMM (a torchao ``CastConfig``): fp8 dtype, scales along an axis (else one per
    tensor), scales rounded down to powers of 2."""

    dtype: torch.dtype
    axiswise: bool
    pow2: bool


@dataclass(frozen=True)
class _Recipe:
    """A ``Float8LinearConfig`` as the styles use it: the six casts (input, weight, grad_output, each for its two
    GEMMs) and each GEMM's fast accumulation (torchao's local GEMMs only: the ops have none)."""

    input: _Cast
    input_gw: _Cast
    weight: _Cast
    weight_gi: _Cast
    grad: _Cast
    grad_gw: _Cast
    fast_out: bool
    fast_gi: bool
    fast_gw: bool

    @classmethod
    def of(cls, config: Any) -> _Recipe | None:
        """The recipe of a ``Float8LinearConfig``; None where the styles leave it to torchao (a cast disabled or to
        a dtype the ops do not take, such as ROCm's fnuz, emulation, inner-dimension padding, FSDP's float8 weight
        all-gather)."""
        from torchao.float8.config import ScalingGranularity, ScalingType

        casts = (config.cast_config_input, config.cast_config_input_for_grad_weight, config.cast_config_weight,
                 config.cast_config_weight_for_grad_input, config.cast_config_grad_output,
                 config.cast_config_grad_output_for_grad_weight)
        if (any(c.scaling_type is not ScalingType.DYNAMIC or c.target_dtype not in FP8_DTYPES for c in casts)
                or config.emulate or config.pad_inner_dim or config.enable_fsdp_float8_all_gather):
            return None
        pow2 = bool(config.round_scales_to_power_of_2)
        made = [_Cast(c.target_dtype, c.scaling_granularity is ScalingGranularity.AXISWISE, pow2) for c in casts]
        return cls(*made, config.gemm_config_output.use_fast_accum, config.gemm_config_grad_input.use_fast_accum,
                   config.gemm_config_grad_weight.use_fast_accum)

    @property
    def reuse_input(self) -> bool:
        """The input's fp8 for the output GEMM serves the weight gradient's too (one tensor-wise scale)."""
        return not self.input.axiswise and not self.input_gw.axiswise

    @property
    def reuse_grad(self) -> bool:
        """The gradient's fp8 for the input gradient serves the weight gradient's too."""
        return not self.grad.axiswise and not self.grad_gw.axiswise


@dataclass(frozen=True, eq=False)
class _Call:
    """What one sharded linear's autograd function needs besides tensors: its recipe, mesh, group and the ops'
    path; ``sequence``: its tokens are sharded (the all-gather / reduce-scatter forms)."""

    recipe: _Recipe
    mesh: DeviceMesh
    path: str
    sequence: bool

    @property
    def group(self) -> Any:
        return self.mesh.get_group()


# -- casts, products, gathers ----------------------------------------------------------------------------------------


def _cast(t: torch.Tensor, cast: _Cast, axis: int, split: bool, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in fp8 with torchao's scale (``fp8 = t * scale``): one per tensor, or per slice along ``axis`` (amax
    over ``axis``, kept as a size-1 dimension). ``split``: the amax's extent is sharded over the mesh, so it is the
    group's (all-reduce MAX), as torchao's ``reduce_amax``."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    granularity = ScalingGranularity.AXISWISE if cast.axiswise else ScalingGranularity.TENSORWISE
    scale = tensor_to_scale(t, cast.dtype, reduce_amax=split, device_mesh=mesh if split else None,
                            scaling_granularity=granularity, axiswise_dim=axis if cast.axiswise else None,
                            round_scales_to_power_of_2=cast.pow2)
    return to_fp8_saturated(t.to(torch.float32) * scale, cast.dtype), scale


def _paired(scale_a: torch.Tensor, scale_b: torch.Tensor, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales of ``a [rows, K] @ b [K, columns]`` in one mode: a tensor-wise scale beside an axis-wise one repeated
    along the rows or columns (torchao's ``preprocess_addmm``)."""
    if scale_a.numel() == 1 and scale_b.ndim == 2 and scale_b.numel() > 1:
        scale_a = scale_a.reshape(1).repeat(rows).reshape(-1, 1)
    elif scale_b.numel() == 1 and scale_a.ndim == 2 and scale_a.numel() > 1:
        scale_b = scale_b.reshape(1).repeat(columns).reshape(1, -1)
    return scale_a, scale_b


def _inverse(scale_a: torch.Tensor, scale_b: torch.Tensor, rows: int, columns: int,
             out_dtype: torch.dtype) -> Scales:
    """The ops' scales (``torch._scaled_mm``'s: dequantising, the reciprocal of torchao's) and output dtype."""
    scale_a, scale_b = _paired(scale_a, scale_b, rows, columns)
    return Scales.of(scale_a.reciprocal(), scale_b.reciprocal(), out_dtype)


def _column_major(b: torch.Tensor) -> torch.Tensor:
    """``b`` laid out column-major, as cuBLAS's scaled matmul takes its second operand."""
    return b if b.stride(0) == 1 else b.t().contiguous().t()


def _out_dtype(dtype: torch.dtype, rowwise: bool) -> torch.dtype:
    """The ops' output dtype for a module of ``dtype`` (they give bf16 or fp32): torchao's rule, bf16 for row-wise
    scaling (torch's row-wise scaled matmul had no fp32 output), the module's dtype otherwise, fp32 for fp16."""
    return torch.bfloat16 if dtype == torch.bfloat16 or rowwise else torch.float32


def _mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, dtype: torch.dtype,
        fast: bool) -> torch.Tensor:
    """A local scaled product as ``Float8Linear`` computes it (torchao's ``addmm_float8_unwrapped``, torchao's
    scales), in ``dtype``."""
    from torchao.float8.float8_ops import addmm_float8_unwrapped

    scale_a, scale_b = _paired(scale_a, scale_b, a.shape[0], b.shape[1])
    return addmm_float8_unwrapped(a.contiguous(), scale_a, _column_major(b), scale_b, dtype, use_fast_accum=fast)


def _gather(rows: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The ranks' fp8 ``rows`` concatenated in rank order, moved as bytes (gloo has no fp8)."""
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    gathered = gather(rows.contiguous().view(torch.uint8), 0, mesh.get_group())
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = gathered.wait()
    return gathered.view(rows.dtype)


def _rowwise(*casts: _Cast) -> bool:
    return any(c.axiswise for c in casts)


# -- the sharded linears' forward and backward -----------------------------------------------------------------------


def _keep(ctx: Any, call: _Call, x: torch.Tensor, x8: torch.Tensor | None, x_scale: torch.Tensor,
          weight: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Save what a backward needs (the fp8 input ``x8`` and its scale where the recipe reuses them, else ``x``) and
    return ``y`` in ``x``'s dtype."""
    if call.recipe.reuse_input:
        ctx.save_for_backward(x8, x_scale, weight)
    else:
        ctx.save_for_backward(x, None, weight)
    ctx.call = call
    return y.to(x.dtype)


def _forward_casts(x: torch.Tensor, weight: torch.Tensor, call: _Call, rowwise: bool) -> tuple[torch.Tensor, ...]:
    """The forward product's fp8 operands ``(x8, x_scale, w8, w_scale)``, cast before the autograd function rather
    than in its ``forward``: traced by ``torch.compile(dynamic=True)``, torchao's scale (its amax all-reduced over the
    mesh) inside the function's forward fails in Dynamo. Colwise: x's amax is the group's where its rows are
    sharded (tensor-wise), the weight's per output channel (tensor-wise: the group's); rowwise: x and the weight hold
    this rank's part of K, so every amax, tensor- or axis-wise, is the group's."""
    recipe, mesh = call.recipe, call.mesh
    x_split = True if rowwise else call.sequence and not recipe.input.axiswise
    w_split = True if rowwise else not recipe.weight.axiswise
    return (*_cast(x.detach(), recipe.input, -1, x_split, mesh),
            *_cast(weight.detach(), recipe.weight, -1, w_split, mesh))


class _ColwiseLinear(torch.autograd.Function):
    """``y_r = x @ w_r.t()`` for a colwise shard ``w_r [N/W, K]``; ``x``: the input rows, ``[M/W, K]`` sharded
    (``call.sequence``: gathered by the product) or ``[M, K]`` whole."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, call: _Call, casts: tuple) -> torch.Tensor:
        recipe, (x8, x_scale, w8, w_scale) = call.recipe, casts  # _forward_casts'
        w_scale = w_scale.t() if recipe.weight.axiswise else w_scale  # [1, N/W] for b = w8.t()
        out = _out_dtype(x.dtype, _rowwise(recipe.input, recipe.weight))
        x_full8 = x8
        if call.sequence:
            scales = _inverse(x_scale, w_scale, x8.shape[0], w8.shape[0], out)
            if recipe.reuse_input:  # the gathered fp8 input serves the weight gradient
                y, x_full8, _ = scaled_ops.all_gather_scaled_gemm_gathered(x8, w8.t(), scales, call.group,
                                                                           call.path)
            else:
                y = scaled_ops.all_gather_scaled_gemm(x8, w8.t(), scales.a, scales.b, call.group, out_dtype=out,
                                                      path=call.path)
        else:
            y = _mm(x8, x_scale, w8.t(), w_scale, out, recipe.fast_out)
        return _keep(ctx, call, x, x_full8, x_scale, weight, y)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        call, recipe, mesh, (saved_x, x_scale, weight) = ctx.call, ctx.call.recipe, ctx.call.mesh, ctx.saved_tensors
        dtype = dy.dtype
        # dy [M, N/W]: every row, this rank's columns; a row's amax spans the group's columns.
        dy8, dy_scale = _cast(dy, recipe.grad, -1, True, mesh)
        dx = None
        if ctx.needs_input_grad[0]:
            w8, w_scale = _cast(weight, recipe.weight_gi, 0, True, mesh)  # per input channel, over N: the group's
            scales = _inverse(dy_scale, w_scale, dy8.shape[0], w8.shape[1], _out_dtype(dtype, _rowwise(
                recipe.grad, recipe.weight_gi)))
            op = scaled_ops.scaled_gemm_reduce_scatter if call.sequence else scaled_ops.scaled_gemm_all_reduce
            dx = op(dy8, _column_major(w8), scales.a, scales.b, call.group, out_dtype=scales.out_dtype,
                    path=call.path).to(dtype)
        dw = None
        if ctx.needs_input_grad[1]:
            if recipe.reuse_grad:
                dy8_gw, dy_scale_gw = dy8, dy_scale
            else:  # per output channel, over the tokens: all of them are here (tensor-wise: the group's)
                dy8_gw, dy_scale_gw = _cast(dy, recipe.grad_gw, 0, not recipe.grad_gw.axiswise, mesh)
            if recipe.reuse_input:
                x8, x_scale_gw = saved_x, x_scale
            else:  # per input channel, over the tokens: the group's when they are sharded, then gathered
                x8, x_scale_gw = _cast(saved_x, recipe.input_gw, 0, call.sequence, mesh)
                x8 = _gather(x8, mesh) if call.sequence else x8
            dy_scale_gw = dy_scale_gw.t() if recipe.grad_gw.axiswise else dy_scale_gw
            dw = _mm(dy8_gw.t(), dy_scale_gw, x8, x_scale_gw, dtype, recipe.fast_gw)
        return dx, dw, None, None


class _RowwiseLinear(torch.autograd.Function):
    """``y = sum_r x_r @ w_r.t()`` for a rowwise shard ``w_r [N, K/W]`` and ``x_r [M, K/W]``: reduce-scattered
    by rows (``call.sequence``: ``y_r [M/W, N]``) or all-reduced (``[M, N]`` on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, call: _Call, casts: tuple) -> torch.Tensor:
        recipe, (x8, x_scale, w8, w_scale) = call.recipe, casts  # _forward_casts'
        w_scale = w_scale.t() if recipe.weight.axiswise else w_scale
        out = _out_dtype(x.dtype, _rowwise(recipe.input, recipe.weight))
        scales = _inverse(x_scale, w_scale, x8.shape[0], w8.shape[0], out)
        op = scaled_ops.scaled_gemm_reduce_scatter if call.sequence else scaled_ops.scaled_gemm_all_reduce
        y = op(x8, w8.t(), scales.a, scales.b, call.group, out_dtype=out, path=call.path)
        return _keep(ctx, call, x, x8, x_scale, weight, y)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        call, recipe, mesh, (saved_x, x_scale, weight) = ctx.call, ctx.call.recipe, ctx.call.mesh, ctx.saved_tensors
        dtype = dy.dtype
        # dy: [M/W, N] (sequence) or [M, N]; whole rows either way.
        dy8, dy_scale = _cast(dy, recipe.grad, -1, call.sequence and not recipe.grad.axiswise, mesh)
        dy_full8 = dy8
        dx = None
        if ctx.needs_input_grad[0] or (call.sequence and recipe.reuse_grad):
            w8, w_scale = _cast(weight, recipe.weight_gi, 0, not recipe.weight_gi.axiswise, mesh)  # over N: here
            out = _out_dtype(dtype, _rowwise(recipe.grad, recipe.weight_gi))
            if call.sequence:
                scales = _inverse(dy_scale, w_scale, dy8.shape[0], w8.shape[1], out)
                if recipe.reuse_grad:  # the gathered fp8 gradient serves the weight gradient
                    dx, dy_full8, _ = scaled_ops.all_gather_scaled_gemm_gathered(dy8, _column_major(w8), scales,
                                                                                 call.group, call.path)
                else:
                    dx = scaled_ops.all_gather_scaled_gemm(dy8, _column_major(w8), scales.a, scales.b, call.group,
                                                           out_dtype=out, path=call.path)
            else:
                dx = _mm(dy8, dy_scale, w8, w_scale, out, recipe.fast_gi)
            dx = dx.to(dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            if recipe.reuse_grad:
                dy8_gw, dy_scale_gw = dy_full8, dy_scale
            else:  # per output channel, over the tokens: the group's when they are sharded, then gathered
                dy8_gw, dy_scale_gw = _cast(dy, recipe.grad_gw, 0, call.sequence, mesh)
                dy8_gw = _gather(dy8_gw, mesh) if call.sequence else dy8_gw
            if recipe.reuse_input:
                x8, x_scale_gw = saved_x, x_scale
            else:  # per input channel, over the tokens: all of them are here
                x8, x_scale_gw = _cast(saved_x, recipe.input_gw, 0, not recipe.input_gw.axiswise, mesh)
            dy_scale_gw = dy_scale_gw.t() if recipe.grad_gw.axiswise else dy_scale_gw
            dw = _mm(dy8_gw.t(), dy_scale_gw, x8, x_scale_gw, dtype, recipe.fast_gw)
        return dx, dw, None, None


# -- the styles ------------------------------------------------------------------------------------------------------


def _checked_float8_linear(style: Any, module: nn.Module) -> _Recipe | None:
    """torchao's styles' checks (a ``Float8Linear`` with dynamic input and gradient casts), and the recipe where
    the overlapped forms can run it."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import _float8_linear_supports_float8_allgather

    if not isinstance(module, Float8Linear):
        raise ValueError(f"{type(style).__name__}: expecting module to be Float8Linear but found {type(module)} "
                         "(convert the model with torchao.float8.convert_to_float8_training first)")
    if not _float8_linear_supports_float8_allgather(module):
        raise AssertionError(f"{type(style).__name__}: unsupported: the input and grad_output casts must be dynamic")
    return _Recipe.of(module.config)


def _runs_fp8(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the overlapped forms take this call (else torchao's path): a high-precision input of the weight's
    dtype not already cast to fp8, at least one row, no autocast (``Float8Linear`` would cast the input)."""
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

    return (x.dtype in DTYPES and x.dtype == weight.dtype and x.ndim >= 2 and x.numel() > 0
            and not tensor_already_casted_to_fp8(x) and not tensor_already_casted_to_fp8(weight)
            and not torch.is_autocast_enabled())


class _Float8Linear:
    """What both styles add to flashoverlap's bf16 styles: torchao's input and output hooks (its casts to fp8),
    ``Float8Linear.forward`` where the overlapped forms do not apply, and the recipe fixed at ``_apply``."""

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None, use_local_output: bool = True,
                 path: str = "auto") -> None:
        _torchao(type(self).__name__)
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output, path=path)

    def _prepare_input_fn(self, input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any,
                          device_mesh: DeviceMesh) -> Any:
        """torchao's input hook (its cast to fp8), of its style of this name."""
        return self._theirs()._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    def _prepare_output_fn(self, output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: DeviceMesh) -> Any:
        return self._theirs()._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

    def _reproduces(self, module: nn.Module) -> bool:
        """The fp8 styles reproduce ``Float8Linear.forward`` (``_checked_float8_linear`` refused anything else)."""
        from torchao.float8.float8_linear import Float8Linear

        return styles.own_forward(module) is Float8Linear.forward

    def _theirs(self) -> type:
        from torchao.float8 import float8_tensor_parallel

        return getattr(float8_tensor_parallel, type(self).__name__)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        recipe = _checked_float8_linear(self, module)
        ours = next(base for base in type(self).__mro__ if base in (styles.ColwiseParallel, styles.RowwiseParallel))
        if recipe is None:  # torchao's style outright: PyTorch's style of the same name with torchao's hooks
            return getattr(torch_styles, ours.__name__)._apply(self, module, device_mesh)
        module._flashoverlap_float8_recipe = recipe
        return ours._apply(self, module, device_mesh)

    def _torch_forward(self, module: nn.Module, x: torch.Tensor, binding: _Binding) -> Any:
        """Exactly what torchao's style runs: its input hook, ``Float8Linear.forward``, its output hook."""
        x = self._prepare_input_fn(self.input_layouts, self.desired_input_layouts, module, (x,), binding.mesh)
        y = styles.own_forward(module)(module, x)  # the class below flashoverlap's routing: Float8Linear
        return self._prepare_output_fn(self.output_layouts, self.use_local_output, module, y, binding.mesh)

    def _call(self, module: nn.Module, binding: _Binding, sequence: bool) -> _Call:
        return _Call(module._flashoverlap_float8_recipe, binding.mesh, self.path, sequence)

    def _product(self, rows: torch.Tensor, weight: torch.Tensor, module: nn.Module, binding: _Binding,
                 sequence: bool) -> torch.Tensor:
        """The style's sharded product (``_function``, its autograd function), the fp8 operands cast first."""
        call = self._call(module, binding, sequence)
        return self._function.apply(rows, weight, call, _forward_casts(rows, weight, call, self._shards_k))


class Float8ColwiseParallel(_Float8Linear, styles.ColwiseParallel):
    """torchao's ``Float8ColwiseParallel`` (same arguments and layouts; ``weight`` and ``bias`` ``Shard(0)``) on a
    ``Float8Linear``, whose product runs ``all_gather_scaled_gemm`` when its input is sharded on a dimension other
    than the last (``input_layouts=Shard(1)``: the gather moves fp8 rows and scales; backward
    ``scaled_gemm_reduce_scatter``) and a local scaled matmul when it is a plain tensor annotated ``Replicate``
    (backward ``scaled_gemm_all_reduce``). Other cases run as torchao's style runs them (module docstring).
    ``path``: the ops' path."""

    _function, _shards_k = _ColwiseLinear, False

    def _linear_forward(self, module: nn.Module, x: torch.Tensor, binding: _Binding) -> Any:
        layout, local = _input_layout(x, self.input_layouts[0], binding.mesh)
        weight = module.weight.to_local()  # [N/W, K]
        if layout is None or not _runs_fp8(local, weight) or self._uneven(module, binding):
            return self._fallback(module, x, binding)
        if isinstance(layout, Replicate) and not isinstance(x, DTensor):
            self._agree_on_branch(local, binding, False)  # a local product: its forward exchanges nothing
            rows = local.reshape(-1, local.shape[-1])
            y_rows = self._product(rows, weight, module, binding, False)
            y = y_rows.view(*local.shape[:-1], y_rows.shape[-1])
        elif isinstance(layout, Shard) and layout.dim < local.ndim - 1 and (
                not isinstance(x, DTensor) or x.shape[layout.dim] % binding.world == 0):
            if isinstance(x, DTensor):
                local = x.to_local()
            y_rows = self._product(_rows_major(local, layout.dim), weight, module, binding, True)
            y = _from_rows(y_rows, local, layout.dim, local.shape[layout.dim] * binding.world)
        else:  # a Replicate DTensor (PrepareModuleInput's), uneven shards: torchao's
            return self._fallback(module, x, binding)
        if module.bias is not None:
            y = y + module.bias.to_local().to(y.dtype)
        if self.use_local_output and _normalize(self.output_layouts[0], y.ndim) == Shard(y.ndim - 1):
            return y
        y = DTensor.from_local(y, binding.mesh, [Shard(y.ndim - 1)], run_check=False)
        if y.placements != tuple(self.output_layouts):
            y = y.redistribute(placements=self.output_layouts)
        return y.to_local() if self.use_local_output else y


class Float8RowwiseParallel(_Float8Linear, styles.RowwiseParallel):
    """torchao's ``Float8RowwiseParallel`` (same arguments and layouts; ``weight`` ``Shard(1)``, ``bias``
    ``Replicate``) on a ``Float8Linear``, whose product runs ``scaled_gemm_reduce_scatter`` when its output is sharded
    on a dimension other than the last (``output_layouts=Shard(1)``; backward ``all_gather_scaled_gemm`` of the fp8
    gradient) and ``scaled_gemm_all_reduce`` when it is ``Replicate``. Its input must be sharded on the last
    dimension; other cases run as torchao's style runs them (module docstring). ``path``: the ops' path."""

    _runs = staticmethod(_runs_fp8)
    _function, _shards_k = _RowwiseLinear, True


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """torchao's ``PrepareFloat8ModuleInput`` (same arguments: ``input_layouts``, ``desired_input_layouts``,
    ``input_kwarg_layouts``, ``desired_input_kwarg_layouts``, ``use_local_output``, ``float8_dtype``,
    ``fwd_config_submodule_fqn``): the module's inputs cast to fp8 (tensor-wise, e4m3, the group's amax) before
    their redistribution, so that one fp8 all-gather serves every projection that reads them. The projections then
    run as torchao's styles run them (the gather is shared, not overlapped with one product)."""

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: Any = None, desired_input_kwarg_layouts: Any = None,
                 use_local_output: bool = False, float8_dtype: torch.dtype = torch.float8_e4m3fn,
                 fwd_config_submodule_fqn: str | None = None) -> None:
        _torchao(type(self).__name__)
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                         input_kwarg_layouts=input_kwarg_layouts,
                         desired_input_kwarg_layouts=desired_input_kwarg_layouts, use_local_output=use_local_output)
        if float8_dtype != torch.float8_e4m3fn:
            raise NotImplementedError("PrepareFloat8ModuleInput only supports casting to float8_e4m3fn, got "
                                      f"{float8_dtype}")
        self.float8_dtype = float8_dtype
        self.linear_mm_config = None
        self.fwd_config_submodule_fqn = fwd_config_submodule_fqn

    def _prepare_input_arg(self, input: Any, mesh: DeviceMesh, input_layout: Any, desired_layout: Any) -> Any:
        from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput as Theirs

        return Theirs._prepare_input_arg(self, input, mesh, input_layout, desired_layout)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torchao.float8.float8_linear import Float8Linear

        if self.fwd_config_submodule_fqn is not None:
            source = module.get_submodule(self.fwd_config_submodule_fqn)
            if not isinstance(source, Float8Linear):
                raise ValueError(f"PrepareFloat8ModuleInput: fwd_config_submodule_fqn "
                                 f"{self.fwd_config_submodule_fqn!r} is a {type(source).__name__}, not a Float8Linear")
            self.linear_mm_config = source.linear_mm_config
        else:
            configs = {m.linear_mm_config for m in module.modules() if isinstance(m, Float8Linear)}
            if len(configs) > 1:
                raise ValueError("PrepareFloat8ModuleInput: the Float8Linear modules under this module differ in "
                                 "linear_mm_config: name the one to follow with fwd_config_submodule_fqn")
            self.linear_mm_config = next(iter(configs), None)
        if self.linear_mm_config is None:
            raise ValueError("PrepareFloat8ModuleInput: no Float8Linear under this module (convert the model with "
                             "torchao.float8.convert_to_float8_training first)")
        super()._apply(module, device_mesh)
        return module
