"""Tuning policy the ops consult, no GPU harness: the measured rates behind default plans (``rates``), the on-disk
plan cache (``cache``), the performance model (``model``), the plan search (``search``), the grouped-GEMM choice
(``grouped``, its fitted costs in ``grouped_costs``) and the fp8 GEMM tiles (``fp8``). The measuring side, which
times plans on the GPUs, is ``tuner`` with ``timing`` (``flashoverlap tune bandwidth|plan``)."""
