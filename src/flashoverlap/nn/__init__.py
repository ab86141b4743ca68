"""Tensor-parallel and expert-parallel layers on flashoverlap's ops (autograd, ``torch.compile``, CUDA graphs); fp8
experts: ``ExpertParallelMLP(..., fp8="row")`` (training, torchao's row-wise MoE recipe) and
``Float8ExpertParallelMLP.from_float`` (inference)."""

from flashoverlap.nn.float8 import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
from flashoverlap.nn.fp8_moe import Float8ExpertParallelMLP
from flashoverlap.nn.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_sequence_parallel,
    parallelize,
    sync_sequence_parallel_grads,
)
from flashoverlap.nn.moe import ExpertParallelMLP, MoEBlock, MoEExpert, route
from flashoverlap.nn.styles import ColwiseParallel, ReplicatedWithGradAllReduce, RowwiseParallel, styles_from_hf_plan

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "mark_sequence_parallel", "parallelize",
           "sync_sequence_parallel_grads"]
__all__ += ["ExpertParallelMLP", "Float8ExpertParallelMLP", "MoEBlock", "MoEExpert", "route"]
__all__ += ["ColwiseParallel", "ReplicatedWithGradAllReduce", "RowwiseParallel", "styles_from_hf_plan"]
__all__ += ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]
