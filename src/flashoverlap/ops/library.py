"""The ops as PyTorch custom ops (``torch.ops.flashoverlap.*``), with fake implementations and autograd.

Registered with ``torch.library``, taking the process group by name, so that ``torch.compile(fullgraph=True)``
traces a model that calls them and Inductor treats them as opaque (it never re-traces our Triton kernels); a CUDA
graph captures them like any op. Plans are not arguments: a custom op runs the plan the library chooses (the
tuned one from the plan cache where there is one).

Autograd, with every backward on the overlapped ops where the math allows (``W`` ranks, rank r); a backward's
communicating product and its weight gradient are one custom op (``*_backward``), the weight gradient issued
where the product would wait for its first pull, so that the pulls hide behind it:

- ``gemm_all_reduce(a_r [M, K/W], b_r [K/W, N]) -> c [M, N]`` (row-parallel linear): ``grad_a_r = grad_c @ b_r^T``,
  ``grad_b_r = a_r^T @ grad_c`` (``grad_c`` is the same on every rank): no communication.
- ``gemm_reduce_scatter(a_r [M, K/W], b_r) -> y_r [M/W, N]`` (row-parallel, sequence parallel): ``grad_a_r =
  all_gather(grad_y) @ b_r^T`` by ``all_gather_gemm``, whose gathered ``grad_y`` also gives ``grad_b_r = a_r^T @
  all_gather(grad_y)``.
- ``all_gather_gemm(x_r [M/W, K], b_r [K, N/W]) -> c_r [M, N/W]`` (column-parallel, sequence parallel):
  ``grad_x_r`` = rank r's rows of ``sum_q grad_c_q @ b_q^T`` by ``gemm_reduce_scatter``; ``grad_b_r =
  all_gather(x)^T @ grad_c_r`` with the gathered input kept from the forward.
- ``linear_column(x [M, K], w_r [N/W, K]) -> x @ w_r^T`` (column-parallel without sequence parallelism: ``x`` is
  the same on every rank): ``grad_x = sum_q grad_y_q @ w_q`` by ``gemm_all_reduce``, ``grad_w_r = grad_y_r^T @ x``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group

from flashoverlap.comm.replay import Matmul
from flashoverlap.plan import Plan
from flashoverlap.runtime.calls import GEMM, GemmSpec, execute
from flashoverlap.runtime.checks import check_group


def group_name(group: dist.ProcessGroup | None, op: str = "flashoverlap") -> str:
    """The name a custom op takes for ``group`` (None: the default group). Anything but a process group is refused
    as ``checks.check_group`` refuses it on a call that skips the custom op, naming ``op``."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(f"{op}: torch.distributed is not initialised; call dist.init_process_group()")
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        check_group(op, group)  # raises: a DeviceMesh, a group's name, a non-member's placeholder
    return group.group_name


def needed(name: str, tensors: tuple, plan: Plan | None = None) -> bool:
    """Whether a public op's call goes through its custom op: where autograd must record it (a tensor among
    ``tensors`` requires grad), or ``torch.compile`` traces it. Plain eager calls skip the dispatcher (host time)."""
    grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)
    if grad and plan is not None:
        raise ValueError(f"{name}: plan= cannot be combined with autograd (an input requires grad); leave plan unset "
                         "(the library's plan for the shape, tuned where the plan cache has one) or detach the inputs")
    return grad or torch.compiler.is_compiling()


def refuse_grad(name: str, named: tuple, advice: str) -> None:
    """The fp8 ops record no autograd: with grad enabled, an operand among ``named`` (``(argument, tensor)`` pairs)
    that requires grad raises, naming it, rather than a result whose gradient would silently never come
    (``advice``: what to do instead)."""
    if torch.is_grad_enabled():
        for arg, t in named:
            if getattr(t, "requires_grad", False):
                raise ValueError(f"{name}: {arg} requires grad, but the fp8 ops record no autograd (its gradient "
                                 f"would never come): {advice}")


def _world(name: str) -> int:
    return dist.get_world_size(_resolve_process_group(name))


def _group(name: str) -> dist.ProcessGroup:
    return _resolve_process_group(name)


@torch.library.custom_op("flashoverlap::gemm_all_reduce", mutates_args=())
def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, group: str, path: str = "auto") -> torch.Tensor:
    return execute(GEMM, GemmSpec("gemm_all_reduce", "all_reduce", a, b, _group(group), None, path))[0]


@gemm_all_reduce.register_fake
def _(a, b, group, path="auto"):
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("flashoverlap::gemm_reduce_scatter", mutates_args=())
def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: str, path: str = "auto") -> torch.Tensor:
    return execute(GEMM, GemmSpec("gemm_reduce_scatter", "reduce_scatter", a, b, _group(group), None, path))[0]


@gemm_reduce_scatter.register_fake
def _(a, b, group, path="auto"):
    return a.new_empty((a.shape[0] // _world(group), b.shape[1]))


@torch.library.custom_op("flashoverlap::all_gather_gemm", mutates_args=())
def all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, group: str,
                    path: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    c, gathered = execute(GEMM, GemmSpec("all_gather_gemm", "all_gather", a_shard, b, _group(group), None, path, True))
    return c, gathered


@all_gather_gemm.register_fake
def _(a_shard, b, group, path="auto"):
    rows = a_shard.shape[0] * _world(group)
    return a_shard.new_empty((rows, b.shape[1])), a_shard.new_empty((rows, a_shard.shape[1]))


@torch.library.custom_op("flashoverlap::linear_column", mutates_args=())
def linear_column(x: torch.Tensor, w: torch.Tensor, group: str, path: str = "auto") -> torch.Tensor:
    return torch.mm(x, w.t())


@linear_column.register_fake
def _(x, w, group, path="auto"):
    return x.new_empty((x.shape[0], w.shape[0]))


def _empty_like_layout(b: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``b``'s shape laid out as ``b`` is: ``b`` is mostly ``w.t()``, a column-major view of a
    weight, and a weight gradient in the other layout costs a strided copy when autograd hands it to ``w.grad``, and
    a strided (unvectorised) add each time gradients accumulate: 6 ms of a 4096-token training step of the block
    at TP = 1, profiled on an H200 (``benchmarks/diagnostics/block_profile.py``). Fake tensors get the same layout."""
    if not b.is_contiguous() and b.t().is_contiguous():
        return b.new_empty((b.shape[1], b.shape[0])).t()
    return b.new_empty(b.shape)


# -- backward passes: the communicating product with the weight gradient as its independent work ----------------
# A plain-PyTorch backward overlaps a collective with the next GEMM for free (the collective is asynchronous); these
# ops give the overlapped op the weight gradient as the independent work that hides its pulls (``execute``'s hook).
@torch.library.custom_op("flashoverlap::all_gather_gemm_backward", mutates_args=())
def all_gather_gemm_backward(grad_c: torch.Tensor, b: torch.Tensor, gathered: torch.Tensor, group: str,
                             path: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_a_r = reduce_scatter(grad_c @ b^T)``, ``grad_b = gathered^T @ grad_c``."""
    grad_b = _empty_like_layout(b)  # [K, N/W]: gathered^T @ grad_c
    grad_a, _ = execute(GEMM, GemmSpec("all_gather_gemm backward", "reduce_scatter", grad_c, b.t(), _group(group),
                                       path=path, hook=Matmul(gathered.t(), grad_c, grad_b)))
    return grad_a, grad_b


@all_gather_gemm_backward.register_fake
def _(grad_c, b, gathered, group, path="auto"):
    return grad_c.new_empty((grad_c.shape[0] // _world(group), b.shape[0])), _empty_like_layout(b)


@torch.library.custom_op("flashoverlap::gemm_reduce_scatter_backward", mutates_args=())
def gemm_reduce_scatter_backward(grad_y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: str,
                                 path: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_a = all_gather(grad_y) @ b^T``; ``grad_b = a^T @ all_gather(grad_y)``, this rank's own rows first
    (while the peers' arrive), the rest once gathered."""
    process_group = _group(group)
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    rows = grad_y.shape[0]
    own = slice(rank * rows, (rank + 1) * rows)
    grad_b = _empty_like_layout(b)  # [K/W, N]: a^T @ gathered
    grad_a, gathered = execute(GEMM, GemmSpec("gemm_reduce_scatter backward", "all_gather", grad_y, b.t(),
                                              process_group, None, path, True, Matmul(a[own].t(), grad_y, grad_b)))
    for q in range(world):
        if q != rank:
            grad_b.addmm_(a[q * rows : (q + 1) * rows].t(), gathered[q * rows : (q + 1) * rows])
    return grad_a, grad_b


@gemm_reduce_scatter_backward.register_fake
def _(grad_y, a, b, group, path="auto"):
    return a.new_empty(a.shape), _empty_like_layout(b)


@torch.library.custom_op("flashoverlap::linear_column_backward", mutates_args=())
def linear_column_backward(grad_y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group: str,
                           path: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_x = sum_q grad_y_q @ w_q`` (``gemm_all_reduce``), ``grad_w = grad_y^T @ x``."""
    grad_w = torch.empty_like(w)
    grad_x, _ = execute(GEMM, GemmSpec("linear_column backward", "all_reduce", grad_y, w, _group(group), path=path,
                                       hook=Matmul(grad_y.t(), x, grad_w)))
    return grad_x, grad_w


@linear_column_backward.register_fake
def _(grad_y, x, w, group, path="auto"):
    return x.new_empty(x.shape), w.new_empty(w.shape)


# -- autograd ------------------------------------------------------------------------------------------------------
def _keep_operands(ctx, inputs, output) -> None:
    a, b, group, path = inputs
    ctx.save_for_backward(a, b)
    ctx.group, ctx.path = group, path


def _all_reduce_backward(ctx, grad_c):
    a, b = ctx.saved_tensors
    grad_a = torch.mm(grad_c, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = None
    if ctx.needs_input_grad[1]:
        grad_b = torch.mm(a.t(), grad_c, out=_empty_like_layout(b))
    return grad_a, grad_b, None, None


def _reduce_scatter_backward(ctx, grad_y):
    a, b = ctx.saved_tensors
    grad_a, grad_b = torch.ops.flashoverlap.gemm_reduce_scatter_backward(grad_y.contiguous(), a, b, ctx.group,
                                                                         ctx.path)
    return (grad_a if ctx.needs_input_grad[0] else None), (grad_b if ctx.needs_input_grad[1] else None), None, None


def _keep_gathered(ctx, inputs, output) -> None:
    a_shard, b, group, path = inputs
    ctx.save_for_backward(b, output[1])
    ctx.set_materialize_grads(False)  # a gathered input nothing read (the layers', the usual case) costs nothing
    ctx.group, ctx.path = group, path


def _all_gather_backward(ctx, grad_c, grad_gathered):
    """The product's gradients, and the gathered input's own where something read it (``return_gathered``, the
    other projections of a shared input): each rank's rows of it summed over the group, ``all_gather``'s backward."""
    b, gathered = ctx.saved_tensors
    grad_a = grad_b = None
    if grad_c is not None:
        grad_a, grad_b = torch.ops.flashoverlap.all_gather_gemm_backward(grad_c.contiguous(), b, gathered, ctx.group,
                                                                         ctx.path)
    if grad_gathered is not None and ctx.needs_input_grad[0]:
        # reduce_scatter_single where torch has it (reduce_scatter_tensor, its older name, warns FutureWarning there)
        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        rows = scatter(grad_gathered.contiguous(), "sum", 0, _group(ctx.group))
        rows = rows.wait() if isinstance(rows, funcol.AsyncCollectiveTensor) else rows
        grad_a = rows if grad_a is None else grad_a + rows
    return (grad_a if ctx.needs_input_grad[0] else None), (grad_b if ctx.needs_input_grad[1] else None), None, None


def _linear_column_backward(ctx, grad_y):
    x, w = ctx.saved_tensors
    grad_x, grad_w = torch.ops.flashoverlap.linear_column_backward(grad_y.contiguous(), x, w, ctx.group, ctx.path)
    return (grad_x if ctx.needs_input_grad[0] else None), (grad_w if ctx.needs_input_grad[1] else None), None, None


gemm_all_reduce.register_autograd(_all_reduce_backward, setup_context=_keep_operands)
gemm_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_keep_operands)
all_gather_gemm.register_autograd(_all_gather_backward, setup_context=_keep_gathered)
linear_column.register_autograd(_linear_column_backward, setup_context=_keep_operands)
