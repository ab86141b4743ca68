"""The runtime: everything a call resolves between the public op and its communicator (``comm/``), and the one
state object per group (``context``). Modules: ``checks`` (operands, group), ``policy`` (path rules),
``settings`` (the environment, read once per call), ``context`` (per-group state, the communicator table,
``release``), ``calls`` (check, resolve, run; ``plan_for``; the debug agreement check)."""

from flashoverlap.runtime.calls import execute, plan_for
from flashoverlap.runtime.context import release

__all__ = ["execute", "plan_for", "release"]
