"""Tensor-parallel communicators, one per path: ``reference`` (the executable specification, any backend),
``sequential`` (matmul, then one collective), ``nccl`` (the signalling GEMM or cuBLAS bands and NCCL per group),
``p2p`` (cuBLAS sub-bands and copy-engine pulls over symmetric memory, scheduled as a ring: ``ring_schedule``) and
``ring_nccl`` (the same ring over NCCL send/recv, ``path="ring"``)."""
