"""Communicators: each runs one call, behind one protocol (``protocol.py``): built once per (process group,
device) from a ``CommGroup``, then ``run(call) -> (result, gathered input or None)``, and ``release()``.

By kind:
- ``tp/``: tensor-parallel (``reference``, ``sequential``, ``nccl``, ``p2p``, ``ring_nccl``);
- ``expert/``: expert-parallel (MoE) dispatch and combine (``reference``, ``nccl``, ``p2p``; ``contract``: what
  they are given).

Shared mechanics, used by both kinds: ``collectives`` (torch.distributed's collectives as the library issues
them), ``symmetric`` (symmetric-memory workspaces), ``stream_ops`` (stream memory operations, the driver through
ctypes), ``replay`` (calls replayed from CUDA graphs), ``steps`` (the step types every schedule is written in),
``chunked_gemm`` (the grouped GEMMs of the expert paths, chunk by chunk).

The runtime (``flashoverlap.runtime``) builds the communicators from its table and keeps them in each group's
context.
"""
