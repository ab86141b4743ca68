"""The runtime: everything a call resolves between the public op and its communicator (``comm/``), and the one
state object per group (``context``). Modules: ``checks`` (operands, group), ``policy`` (path rules),
``context`` (per-group state, the communicator table, ``release``),
``calls`` (check, resolve, run), ``plans`` (path and plan of a call; ``plan_for``), ``agreement`` (the ranks agree
on a call: the first of each new call always, every call in debug mode). The environment is read once, in
``flashoverlap.settings``."""

from flashoverlap.runtime.calls import execute
from flashoverlap.runtime.context import release
from flashoverlap.runtime.plans import plan_for

__all__ = ["execute", "plan_for", "release"]
