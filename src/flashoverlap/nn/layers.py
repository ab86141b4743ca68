"""Tensor-parallel linear layers on flashoverlap's ops, and a way to convert a model's linears by name.

Shapes, for a group of ``W`` ranks, rank r, tokens flattened to rows (``T``):

- ``ColumnParallelLinear(in, out)``: rank r holds ``weight_r [out/W, in]`` (and ``bias_r [out/W]``).
  ``sequence_parallel=True``: ``x_r [T/W, in]`` (this rank's tokens) -> ``y_r [T, out/W]`` by ``all_gather_gemm``;
  backward: ``grad_x_r`` by ``gemm_reduce_scatter``. Otherwise ``x [T, in]`` (the same on every rank) ->
  ``y_r [T, out/W]``, a local matmul whose backward sums ``grad_x`` over the ranks by ``gemm_all_reduce``.
- ``RowParallelLinear(in, out)``: rank r holds ``weight_r [out, in/W]`` and the whole ``bias [out]``.
  ``sequence_parallel=True``: ``x_r [T, in/W]`` -> ``y_r [T/W, out]`` (this rank's tokens) by
  ``gemm_reduce_scatter``; backward by ``all_gather_gemm``. Otherwise ``-> y [T, out]`` by ``gemm_all_reduce``.

Leading dimensions of ``x`` are kept (``[B, S, in]`` works; with sequence parallelism the flattened tokens are
what is split, so shard along the outermost token dimension). Shards are ``nn.Linear``-shaped, in any dtype the
ops take, on any device: CPU tensors run the reference path (gloo), CUDA tensors the fast paths. bf16 and fp16 are
overlapped; fp32 (``nn.Linear``'s default, so a layer built without ``dtype``) runs ``matmul`` then one collective
on CUDA and the reference path on the CPU, because the overlapped paths' kernels are half-precision. An input whose
dtype differs from the weight's is refused before any communication (``nn.Linear`` would refuse it too, in
``matmul``; here a rank that refused late would leave its peers waiting in a collective).

With sequence parallelism, parameters kept whole on every rank but applied to this rank's tokens only (a row
layer's bias, normalisation weights) get a gradient from this rank's tokens only: ``sync_sequence_parallel_grads``
sums those over the group after backward, as Megatron-LM does.
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.distributed as dist
from torch import nn

from flashoverlap.ops import library  # noqa: F401  (torch.ops.flashoverlap.*)
from flashoverlap.ops.library import group_name
from flashoverlap.runtime.policy import check_path_name

SEQUENCE_PARALLEL_REPLICATED = "_flashoverlap_sequence_parallel"  # marks parameters whose grads need summing


def _rank_and_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("flashoverlap.nn: torch.distributed is not initialised; call dist.init_process_group()")
    group = group if group is not None else dist.group.WORLD
    return dist.get_rank(group), dist.get_world_size(group)


def _split(features: int, world: int, what: str) -> int:
    if features % world:
        raise ValueError(f"{what} = {features} must be divisible by the group's {world} ranks (each holds a shard)")
    return features // world


class _ParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, weight_shape: tuple[int, int], bias_features: int,
                 bias: bool, group, sequence_parallel: bool, path: str, device, dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.world_size = _rank_and_size(group)
        self.group_name = group_name(group, type(self).__name__)
        self.sequence_parallel = sequence_parallel
        self.path = check_path_name(type(self).__name__, path)
        self.weight = nn.Parameter(torch.empty(weight_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(bias_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, with the bounds of the whole layer's fan-in.
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``x`` as rows ``[T, features]`` and its leading dimensions, after checking its dtype against the weight's
        (before any communication, so that no rank refuses while its peers wait in a collective)."""
        if x.dtype != self.weight.dtype:
            name, want = type(self).__name__, str(self.weight.dtype).replace("torch.", "")
            raise ValueError(f"{name}: the input x is {x.dtype} but the layer's weight is {self.weight.dtype}; "
                             f"cast the input (x.to(torch.{want})) or build the layer with "
                             f"dtype={x.dtype} (or call .to({x.dtype}) on it)")
        if self.sequence_parallel and x.ndim < 2:  # the tokens are split along x's first dimension
            raise ValueError(f"{type(self).__name__}: sequence_parallel=True splits x's tokens (its first dimension) "
                             f"over the ranks: x must be [tokens, ..., features], got shape {list(x.shape)}")
        return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, *, sequence_parallel: bool = False, path: str = "auto"):
        """This rank's shard of ``linear``, on its device and in its dtype."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    sequence_parallel=sequence_parallel, path=path, device=linear.weight.device,
                    dtype=linear.weight.dtype)
        with torch.no_grad():
            layer._copy_shard(linear)
        return layer

    def _copy_shard(self, linear: nn.Linear) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"shard {self.rank}/{self.world_size}, sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ weight.T + bias`` with the output features split over the group (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, path: str = "auto", device=None, dtype=None) -> None:
        world = _rank_and_size(group)[1]
        local = _split(out_features, world, "ColumnParallelLinear out_features")
        super().__init__(in_features, out_features, (local, in_features), local, bias, group, sequence_parallel,
                         path, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, lead = self._rows(x)
        if self.sequence_parallel:
            y, _ = torch.ops.flashoverlap.all_gather_gemm(rows, self.weight.t(), self.group_name, self.path)
            lead = (lead[0] * self.world_size, *lead[1:])
        else:
            y = torch.ops.flashoverlap.linear_column(rows, self.weight, self.group_name, self.path)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, y.shape[-1])

    def _copy_shard(self, linear: nn.Linear) -> None:
        """This rank's output features of ``linear``'s weight and bias."""
        rows = slice(self.rank * self.weight.shape[0], (self.rank + 1) * self.weight.shape[0])
        self.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            self.bias.copy_(linear.bias[rows])


class RowParallelLinear(_ParallelLinear):
    """``y = x @ weight.T + bias`` with the input features split over the group (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, path: str = "auto", device=None, dtype=None) -> None:
        world = _rank_and_size(group)[1]
        local = _split(in_features, world, "RowParallelLinear in_features")
        super().__init__(in_features, out_features, (out_features, local), out_features, bias, group,
                         sequence_parallel, path, device, dtype)
        if self.bias is not None and sequence_parallel:
            setattr(self.bias, SEQUENCE_PARALLEL_REPLICATED, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, lead = self._rows(x)
        if self.sequence_parallel:
            if lead[0] % self.world_size:
                raise ValueError(f"RowParallelLinear: {lead[0]} tokens (x's first dimension) cannot be split over "
                                 f"{self.world_size} ranks; pad the sequence to a multiple")
            y = torch.ops.flashoverlap.gemm_reduce_scatter(rows, self.weight.t(), self.group_name, self.path)
            lead = (lead[0] // self.world_size, *lead[1:])
        else:
            y = torch.ops.flashoverlap.gemm_all_reduce(rows, self.weight.t(), self.group_name, self.path)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, y.shape[-1])

    def _copy_shard(self, linear: nn.Linear) -> None:
        """This rank's input features of ``linear``'s weight, and the whole bias."""
        cols = slice(self.rank * self.weight.shape[1], (self.rank + 1) * self.weight.shape[1])
        self.weight.copy_(linear.weight[:, cols])
        if linear.bias is not None:
            self.bias.copy_(linear.bias)


STYLES = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}


def parallelize(model: nn.Module, plan: dict[str, str], group=None, *, sequence_parallel: bool = False,
                path: str = "auto") -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` submodules by their shards, in place, by name: ``plan`` maps a module name
    or pattern (``fnmatch``: ``"layers.*.attn.qkv"``) to ``"colwise"`` or ``"rowwise"``, in the spirit of torch's
    ``parallelize_module``. Every pattern must match at least one ``nn.Linear``; a linear registered under several
    names (tied) becomes one shard under each of them. Returns ``model``."""
    for style in plan.values():
        if style not in STYLES:
            raise ValueError(f"parallelize: style must be one of {sorted(STYLES)}, got {style!r}")
    matched = dict.fromkeys(plan, 0)
    # Every name of every module (a module registered under two names, tied, has both): a shard replaces the
    # linear under each of its names, so that the tie holds.
    modules = list(model.named_modules(remove_duplicate=False))  # listed before any is replaced
    names: dict[int, list[str]] = {}
    for name, module in modules:
        names.setdefault(id(module), []).append(name)
    shards: dict[int, tuple[str, nn.Module]] = {}  # by the linear's id: its style and its shard
    for name, module in modules:
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                if not isinstance(module, nn.Linear):
                    raise ValueError(f"parallelize: {name!r} (matched by {pattern!r}) is a {type(module).__name__}, "
                                     "not an nn.Linear")
                if type(module).__name__ == "Float8Linear":  # torchao's: parallelize's shards run bf16, not fp8
                    raise TypeError(f"parallelize: {name!r} is torchao's Float8Linear, which a "
                                    f"{STYLES[style].__name__} would run in bf16: shard fp8 models with "
                                    "parallelize_module and flashoverlap.nn.Float8ColwiseParallel / "
                                    "Float8RowwiseParallel")
                if type(module).forward is not nn.Linear.forward:  # the shard would run nn.Linear's, silently
                    raise TypeError(f"parallelize: {name!r} is a {type(module).__name__}, an nn.Linear with a forward "
                                    f"of its own, which a {STYLES[style].__name__} would not run: shard it with "
                                    "parallelize_module and flashoverlap.nn.ColwiseParallel / RowwiseParallel "
                                    "(which run such a module as PyTorch's styles do)")
                if not name:  # the model itself: it cannot be replaced in place
                    raise ValueError(f"parallelize: {pattern!r} matches the model itself, an nn.Linear, which cannot "
                                     f"be replaced in place: use {STYLES[style].__name__}.from_linear(model) and keep "
                                     "what it returns")
                done = shards.get(id(module))
                if done is None:
                    shard = STYLES[style].from_linear(module, group, sequence_parallel=sequence_parallel, path=path)
                    shards[id(module)] = (style, shard)
                    for alias in names[id(module)]:
                        parent, _, child = alias.rpartition(".")
                        setattr(model.get_submodule(parent) if parent else model, child, shard)
                elif done[0] != style:
                    raise ValueError(f"parallelize: {name!r} is the same nn.Linear as {names[id(module)][0]!r} "
                                     f"(tied), which the plan shards {done[0]}; it cannot be sharded {style} too")
                matched[pattern] += 1
                break
    missing = [pattern for pattern, count in matched.items() if not count]
    if missing:
        raise ValueError(f"parallelize: no nn.Linear matches {missing}")
    return model


def mark_sequence_parallel(*params: nn.Parameter) -> None:
    """Mark parameters kept whole on every rank but applied to this rank's tokens (normalisation weights under
    sequence parallelism): ``sync_sequence_parallel_grads`` sums their gradients."""
    for param in params:
        setattr(param, SEQUENCE_PARALLEL_REPLICATED, True)


def sync_sequence_parallel_grads(model: nn.Module, group=None) -> None:
    """After backward: sum over ``group`` the gradients of the parameters marked sequence-parallel (a row layer's
    bias with ``sequence_parallel=True``, and those given to ``mark_sequence_parallel``), one all-reduce. Once per
    optimizer step, after the last micro-batch's backward (as Megatron does): the gradients accumulated over the
    micro-batches are each rank's own until then, and a second call would sum the summed ones again."""
    grads = [p.grad for p in model.parameters() if getattr(p, SEQUENCE_PARALLEL_REPLICATED, False)
             and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
