"""Public ops, one file each: argument checks, plan lookup, choosing the path, launching."""

from flashoverlap.ops.gemm_all_reduce import gemm_all_reduce

__all__ = ["gemm_all_reduce"]
