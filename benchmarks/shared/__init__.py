"""Ranks sharing one GPU (issue 42): the pieces of ``benchmarks/shared_ranks.py``.

- ``calls``: a tensor-parallel call as a value (``TpCall``), every rank's operands made from seeds, the oracle each
  rank computes locally, the check, the explicit P2P plan;
- ``experts``: the same for the expert ops (routing, the definition of dispatch and combine);
- ``mechanics``, ``soak``, ``faults``, ``host``: one step each, run in W processes on one GPU;
- ``runs``: what the steps share (the collective budget check, progress files, results files).

Pure parts (specs, oracles, the random call generator, the fault verdict) run on the CPU and are tested in
``tests/benchmarks/test_shared_ranks.py``.
"""
