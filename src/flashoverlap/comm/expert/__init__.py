"""Expert-parallel (MoE) communicators: dispatch and combine, each an all-to-all of token rows around the experts'
grouped GEMMs.

- ``contract``: what they are given (``ExpertPlan``, ``Layout``, ``ExpertCall``), re-exported here as the kind's
  face; ``layout``: building a layer's ``Layout`` (``expert_layout``, collective); ``rows``: the row mechanics
  every path shares (send buffer, weighted sum at the origin).
- ``reference``: the executable specification (``all_to_all_single``, any backend); ``nccl``: NCCL send/recv per
  peer beside the grouped GEMMs; ``p2p``: copy-engine pushes into the peers' symmetric memory (one NVLink node).
  Both fast paths run their GEMMs through ``comm/expert/chunked_gemm.py``.
"""

from flashoverlap.comm.expert.contract import GEMMS, MODES, OPS, ExpertCall, ExpertPlan, HybridCut, Layout
from flashoverlap.comm.expert.layout import BoundExceeded, default_bound, expert_layout
from flashoverlap.comm.expert.rows import check_out

__all__ = ["GEMMS", "MODES", "OPS", "BoundExceeded", "ExpertCall", "ExpertPlan", "HybridCut", "Layout", "check_out",
           "default_bound", "expert_layout"]
