"""The agreement check: before anything collective of a call, every rank of the group must be making the same call.
Always on the first call of each new call (its row: op, shapes, dtype, path, plan, mode), with no switch set, so that
ranks that disagree get an error instead of a wrong result; on every call of the reference path
(``runtime/calls.agree_every_call``: CPU tensors); before every call in debug mode
(``FLASHOVERLAP_DEBUG_TIMEOUT`` or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``). And the error a backend raises inside a call,
re-raised with the op, the group and how to turn the per-call check on.

A call whose row the group agreed on before is not exchanged again (``once``): a repeated call pays nothing. What
that cannot see: a rank that repeats an agreed call while another makes a new one (the first one skips the exchange
the other makes: the other waits, bounded by the group's own timeout), or ranks that each repeat a different agreed
call (neither exchanges: where the bytes they move agree in size, the values are wrong). Seeing those needs an
exchange on every call, which is the per-call check's (debug mode; the reference path always)."""

from __future__ import annotations

import functools
import json
import time
import zlib

import torch
import torch.distributed as dist

from flashoverlap import guards, settings
from flashoverlap.comm.collectives import all_gather_into_tensor
from flashoverlap.plan import Plan
from flashoverlap.runtime.context import GroupContext

# The kinds of call a row describes (a rank making another kind of call differs); "style": a style's rank whose
# forward has no exchange of its own (PyTorch's path, or an op local in its forward: ``calls.agree_on_branch``).
KINDS = ("gemm", "expert", "style")
_HEADER = 16  # every rank's first row has this length, whatever its call: ranks that differ still exchange it
AGREED_LIMIT = 4096  # rows a group's context keeps as agreed before it starts afresh
HINT = ("set TORCH_DISTRIBUTED_DEBUG=DETAIL (or FLASHOVERLAP_DEBUG_TIMEOUT=<seconds>) to have flashoverlap check, "
        "before each call (not only a new call's first), that every rank makes the same call, naming the argument "
        "and the ranks that differ")


Field = str | tuple[str, tuple[str, ...]]  # a row's field: its name, or its name and the names of its codes


def agree(name: str, context: GroupContext, kind: str, fields: tuple, row: list[int], timeout: float | None,
          tail: torch.Tensor | None = None, once: bool = False) -> list[list[int]] | None:
    """Every rank of the group makes the same call: ``row`` (ints, described by ``fields``: a name, or a name and
    what each code stands for) the same on every rank, or every rank raises before any other collective or launch
    of the call, naming the fields that differ (the arguments, their values shown by name) and the ranks. ``tail``:
    int64 values the kind compares itself (a layout's counts); returns every rank's tail, by rank, once the rows agree
    (None without one, or where nothing was exchanged). One or two small all-gathers, each bounded by ``timeout``
    (None, no switch set: the process group's own timeout, which bounds its collectives too, so that a rank the
    program legitimately keeps longer elsewhere is not failed sooner than plain ``torch.distributed`` would fail it):
    a rank that never comes to the call makes the others raise, naming the op and the group. ``once``: nothing is
    exchanged where the group agreed on ``row`` before (the check without a switch: every rank of a group that makes the
    same calls has agreed on the same rows, so every rank skips, or exchanges, alike)."""
    key = (kind, *row)
    if once and key in context.agreed_rows:
        return None
    if timeout is None:
        timeout = group_timeout(context)
    length = 0 if tail is None else tail.numel()
    header = [KINDS.index(kind) + 1, length, *row]
    assert len(header) <= _HEADER, "an agreement row is longer than the header"
    # The group's backend moves the rows: CUDA tensors on NCCL, host tensors otherwise (gloo, ranks sharing a GPU).
    device = context.device if context.device.type == "cuda" and context.nccl else torch.device("cpu")
    local = torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64, device=device)
    rows = gather_rows(name, context, local, timeout, once)
    differ = [rank for rank, other in enumerate(rows) if other != rows[context.rank]]
    if differ:
        other = rows[differ[0]]
        if other[0] != header[0] or other[1] != length and other[2:] == rows[context.rank][2:]:
            what = ["the kind of call (another op, or the same op with other routing)"]
        else:
            what = [f"{_name(field)} ({_value(field, mine)} here, {_value(field, theirs)} on rank {differ[0]})"
                    for field, mine, theirs in zip(fields, row, other[2:]) if mine != theirs] or ["the call"]
        raise ValueError(f"{name}: rank {context.rank} of {context.name}: the ranks disagree on {', '.join(what)}; "
                         f"ranks {differ} differ from this rank: every rank must make the same call with the same "
                         "shapes, dtypes and path")
    tails = None if tail is None else gather_rows(name, context, tail.to(device=device, dtype=torch.int64).reshape(-1),
                                                  timeout, once)
    if len(context.agreed_rows) >= AGREED_LIMIT:  # rows that never repeat: the same count on every rank, so
        context.agreed_rows.clear()  # every rank forgets at the same call
    context.agreed_rows.add(key)
    return tails


def _name(field: Field) -> str:
    return field if isinstance(field, str) else field[0]


def _value(field: Field, code: int) -> str:
    """A row's value as the message shows it: by name where the field names its codes."""
    if isinstance(field, str) or not 0 <= code < len(field[1]):
        return str(code)
    return field[1][code]


def group_timeout(context: GroupContext) -> float:
    """Seconds: a little less than the group's own collective timeout (``init_process_group``'s or ``new_group``'s
    ``timeout``, as its backend holds it), so that this check's error, naming the absent rank, comes before the
    backend's own (gloo's exchange timing out; NCCL's watchdog taking the process down): a tenth of it, at most 30 s,
    sooner. ``settings.AGREEMENT_TIMEOUT`` where the backend does not say."""
    try:
        device = context.device if context.nccl else torch.device("cpu")
        seconds = context.process_group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return settings.AGREEMENT_TIMEOUT
    return seconds - min(30.0, 0.1 * seconds)


def gather_rows(name: str, context: GroupContext, local: torch.Tensor, timeout: float,
                once: bool = False) -> list[list[int]]:
    """Every rank's ``local`` (int64, the same length on every rank), by rank: one all-gather, waited for with
    the deadline (``guards.poll_until``), so that a rank that never comes to the call makes the others raise,
    naming the call, the group and the ranks that did not come, instead of hanging. Each rank marks its arrival in
    the group's store first (``_arrive``), so that the ranks still there can tell which did not come: one that
    skipped the call, raised before it, stalls elsewhere or died. A backend error (gloo's "connection closed by
    peer" once a peer has died or raised) is raised again the same way. ``once``: the check of a new call's first only
    (the message then says that a repeated call is not checked again)."""
    if context.world_size == 1:  # nothing to exchange
        return [local.tolist()]
    arrival = _arrive(context)
    everyone = torch.empty(context.world_size * local.numel(), dtype=torch.int64, device=local.device)
    try:
        work = all_gather_into_tensor(everyone, local, context.process_group, async_op=True)
        guards.poll_until(work.is_completed, time.monotonic() + timeout,
                          lambda: _late(name, context, arrival, timeout, once))
        work.wait()
    except (RuntimeError, dist.DistError) as exc:
        if str(exc).startswith("flashoverlap"):
            raise
        absent = _absent(context, arrival, grace=ARRIVAL_GRACE)
        what = ("every rank had reached it, and one left during it" if absent == [] else
                f"{_who(absent)} never reached it (raised before it, or died)")
        raise RuntimeError(f"flashoverlap: rank {context.rank}: {name} on {context.name}: the agreement exchange "
                           f"failed: {what} ({exc})") from exc
    return everyone.view(context.world_size, -1).tolist()


ARRIVAL_SLOTS = 64  # store keys per rank, reused in turn (the exchanges are in step on every rank)
# Seconds the ranks still on their way to an exchange that failed (a peer left: its connection's error reaches the
# ranks already in the exchange at once) get to mark their arrival before the error names the ranks that did not:
# a rank merely slower than the failure is not named with the one that left.
ARRIVAL_GRACE = 2.0


def _arrive(context: GroupContext) -> tuple | None:
    """Mark this rank's arrival at the group's next agreement exchange in the group's store; returns what
    ``_absent`` needs (None where the group has no store to ask)."""
    try:
        store = dist.distributed_c10d._world.pg_map[context.process_group][1]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    context.exchanges += 1
    exchange = context.exchanges
    try:
        if context.arrival_generation is None:
            # The group's store outlives a context (``release``; the next call makes a new one, whose exchanges count
            # from 1 again): a new context's keys are of a new generation, so that a key a released context wrote
            # never passes for an arrival at the new one's exchange. Contexts are made and released alike on every
            # rank of the group (``release`` is collective), so the generations are in step too.
            context.arrival_generation = store.add(f"flashoverlap/contexts/{context.rank}", 1)
        store.set(_arrival_key(exchange, context.rank), _arrival_mark(context.arrival_generation, exchange))
    except (RuntimeError, dist.DistError):
        return None
    return store, exchange


def _arrival_key(exchange: int, rank: int) -> str:
    """The store key of ``rank``'s arrival at ``exchange``: one of ``ARRIVAL_SLOTS`` per rank, reused in turn (the
    keys a group's store holds stay bounded however many contexts come and go)."""
    return f"flashoverlap/arrived/{exchange % ARRIVAL_SLOTS}/{rank}"


def _arrival_mark(generation: int, exchange: int) -> str:
    """The value an arrival writes: its context's generation and the exchange, both compared."""
    return f"{generation}:{exchange}"


def _absent(context: GroupContext, arrival: tuple | None, grace: float = 0.0) -> list[int] | None:
    """The ranks of the group that had not marked their arrival at this exchange (None: the store cannot say), asked
    again until none is missing or ``grace`` seconds have passed; where the store stops answering during the grace
    (it lived on a rank that has since raised and ended), the last answer it gave."""
    if arrival is None:
        return None
    store, exchange = arrival
    mark = _arrival_mark(context.arrival_generation, exchange)
    deadline = time.monotonic() + grace
    absent, known = list(range(context.world_size)), None
    try:
        while True:
            absent = known = [rank for rank in absent if not store.check([key := _arrival_key(exchange, rank)])
                              or store.get(key).decode() != mark]
            if not absent or time.monotonic() >= deadline:
                return absent
            time.sleep(0.05)
    except (RuntimeError, dist.DistError):  # the store lived on a rank that died
        return known


def _who(absent: list[int] | None) -> str:
    if not absent:
        return "a rank (which one, the group's store cannot say)"
    return f"rank {absent[0]}" if len(absent) == 1 else f"ranks {absent}"


def _late(name: str, context: GroupContext, arrival: tuple | None, timeout: float, once: bool) -> str:
    absent = _absent(context, arrival)
    head = f"flashoverlap: rank {context.rank}: {name} on {context.name}: "
    if absent == []:
        return head + f"every rank reached the call, but its agreement exchange did not end within {timeout:g} s"
    repeated = (", made a call the group had agreed on before (a repeated call is not checked again unless "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL)" if once else "")
    # With no switch set the deadline is a little less than the group's own timeout: the backend's error follows.
    return head + (f"{_who(absent)} did not reach the call within {timeout:g} s (the agreement check): skipped it, "
                   f"raised before it, is stuck elsewhere{repeated}, or died; the group is unusable now")


@functools.lru_cache(maxsize=256)
def digest(plan: Plan) -> int:
    """The same number for the same plan on every rank (``hash`` of a str is salted per process)."""
    return zlib.crc32(json.dumps(plan.to_dict(), sort_keys=True).encode()) & 0x7FFFFFFF


_BACKEND_MARKS = ("gloo", "nccl", "processgroup", "connection", "collective", "enforce fail")


def reraise(exc: BaseException, name: str, group: dist.ProcessGroup | None, env) -> None:
    """Where ``exc`` is a backend's own error escaping a call (not one of flashoverlap's, which name the op already),
    raise it again with the op, the group and, where the agreement check was off, how to turn it on."""
    text = str(exc)
    if text.startswith(name) or text.startswith("flashoverlap"):
        return
    if not isinstance(exc, dist.DistError) and not any(mark in text.lower() for mark in _BACKEND_MARKS):
        return
    try:
        from flashoverlap.comm.protocol import describe

        where = describe(group if group is not None else dist.group.WORLD)
    except (RuntimeError, ValueError, AttributeError):
        where = "its group"
    hint = "" if env.agreement is not None else f"; if the ranks may be making different calls, {HINT}"
    message = f"{name} on {where}: the communication backend failed: {text}{hint}"
    try:
        again = type(exc)(message)
    except TypeError:  # an error type that takes other arguments
        again = RuntimeError(message)
    raise again from exc
