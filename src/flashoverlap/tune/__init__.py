"""Tuning policy the ops consult, no GPU harness: the measured rates behind default plans (``rates``), the on-disk
plan cache (``cache``), the performance model (``model``) and the plan search (``search``). The measuring side,
which times plans on the GPUs, is ``tuner`` with ``timing`` (``flashoverlap tune bandwidth|plan``)."""
