"""Communicators: each runs one call, behind one protocol (``protocol.py``): built once per (process group,
device) from a ``CommGroup``, then ``run(call) -> (result, gathered input or None)``, and ``release()``.

- ``reference``: the plan group by group with ``torch.matmul`` and blocking collectives, on any device (gloo on
  the CPU included); the executable specification and the CPU test oracle.
- ``sequential``: ``matmul`` then one collective, where a plan says overlap cannot pay.
- ``nccl``: FlashOverlap's design, a signalling GEMM (or cuBLAS bands) and ``torch.distributed`` collectives per
  group on a high-priority stream; works across nodes and through host memory.
- ``p2p``: over NVLink, cuBLAS sub-bands, copy-engine pulls from symmetric memory and reductions fused into cuBLAS,
  scheduled as a ring (``ring_schedule``).
- ``ring_nccl``: the same ring with NCCL send/recv for the transfers (``path="ring"``), wherever NCCL runs.
- ``expert_reference``, ``expert_nccl``, ``expert_p2p``: the expert-parallel (MoE) all-to-all calls
  (``expert.py``: their contract).

The runtime (``flashoverlap.runtime``) builds them from its table and keeps them in each group's context.
"""
