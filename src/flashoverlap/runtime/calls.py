"""The one call pipeline: every public op, tensor-parallel and expert, runs through ``execute(kind, spec)``.

The skeleton is the same for every op: read the settings; where calls may replay, answer a call that reads the
tensors of one its communicator replayed from the replay lane (its ``replayer``: the outputs' allocation and one
graph launch, ``comm/replay.CallGraphs.replayer``), by a key that holds the call's signature and where its tensors
lie; let the ranks agree on the call (debug mode: every call), look the call's signature up (a repeated call skips
its checks and lookups: host time before the first launch is GPU idle time when the GPU has nothing queued), and for
a first call let the ranks agree on it (whatever the settings: ranks that disagree raise, none returns a tensor; on
the reference path, whose collectives block the host anyway, on every call), then resolve it once (checks, group
context, path, plan, communicator); switch to the operands' device, and hand the communicator one ``Call``. What
differs per kind of op is a small strategy object (``Kind``): its checks and agreement row, its signature, its plan
builder and the call it builds. ``GEMM`` (this module) serves the tensor-parallel ops, fp8 ones included
(``GemmSpec.scales``); ``EXPERT`` (``runtime/experts.py``) the all-to-all ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from flashoverlap import guards, settings
from flashoverlap.comm import scaled
from flashoverlap.comm.protocol import Call, Hook
from flashoverlap.comm.scaled import Scales
from flashoverlap.plan import OPS, Plan
from flashoverlap.runtime import agreement, plans, policy
from flashoverlap.runtime.checks import DTYPE_CODES, DTYPE_NAMES, check_operands, check_scaled
from flashoverlap.runtime.context import REGISTRY, GroupContext, group_context, resolved_group

# What a resolved call holds: (communicator, plan, bare), where ``bare`` says the plan waits on nothing: no deadline
# (the sequential plan off the reference: the decode case, where host time is the cost; it replays repeated calls).
Entry = tuple[Any, Any, bool]
# Bytes of shared memory a signalling GEMM program takes beyond its K slabs (Triton 3.6: 8 a stage with TMA loads, none
# with pointer loads: its barriers), with room to spare.
SHARED_SLACK = 1024


def agree_every_call(a: Any, path: str, group: Any) -> bool:
    """Whether the ranks agree on every call of an op on ``a`` (its first tensor argument), not only a first one,
    without a switch set: on the reference path (CPU tensors, or ``path="reference"``) of a group of several ranks,
    whose collectives block the host anyway (one more small exchange is its cost), so that ranks each repeating a
    different call raise, which a first-call check cannot see. Decided from the call's own arguments, before the
    cache is asked, so that every rank decides alike whatever its cache holds. The GPU paths agree on a first call
    only: an exchange there would cost every call a host round trip. (The expert layout, ``experts.layout``, takes
    the same rule.)"""
    if path != "reference" and not (isinstance(a, torch.Tensor) and a.is_cpu):  # a Parameter too
        return False
    if group is not None and not isinstance(group, dist.ProcessGroup) or not dist.is_initialized():
        return False  # the checks name it
    try:
        return dist.get_world_size(group) > 1
    except (RuntimeError, ValueError):  # not a member: the checks name it
        return False


BRANCHES = ("flashoverlap's op, no collective in its forward", "PyTorch's path")


def agree_on_branch(name: str, a: torch.Tensor, group: dist.ProcessGroup, path: str, fallback: bool) -> None:
    """A style's rank whose forward runs no exchange of its own: PyTorch's path for an input the ops do not take
    (``fallback``: an empty input, a shard that does not divide), or an op with no collective in its forward (a
    colwise linear's local product). Where the ranks agree on every call (``agree_every_call``: CPU tensors or
    ``path="reference"``; debug mode) it takes part in the group's agreement, so that ranks whose inputs took
    different branches (one here, a peer in an op whose agreement is its first collective, or in the other of the
    two) all raise instead of one returning while another waits in a collective. Ranks that take one branch agree
    and go on. (On the GPU paths without a switch, as for the ops' repeated calls, only debug mode sees it.)"""
    env = settings.current()
    if guards.capturing() or env.agreement is None and not agree_every_call(a, path, group):
        return
    try:
        agreement.agree(name, group_context(name, group, a.device), "style", (("branch", BRANCHES),),
                        [int(fallback)], env.timeout)
    except ValueError as exc:
        raise ValueError(f"{exc} (this rank's input took {BRANCHES[int(fallback)]}: the ranks must pass inputs of "
                         "the same shapes)") from None


class Kind(Protocol):
    """What one kind of op tells the pipeline (a strategy: the pipeline itself is ``execute``)."""

    def agree(self, spec: Any, timeout: float | None, once: bool = False) -> None:
        """Before anything collective of the call: every rank makes the same call, or all raise (``once``: where the
        group has not agreed on this call before; else on every call, debug mode)."""

    def signature(self, spec: Any, env: settings.Settings) -> tuple | None:
        """The call's whole signature (None: not cacheable), after the checks a repeated call must still pass."""

    def lane_key(self, spec: Any, env: settings.Settings) -> tuple | None:
        """The call's replay-lane key (None: none): its signature's every part, and where each tensor it reads lies
        and how it is laid out, so that calls of one key read the same memory the same way (``execute``)."""

    def resolve(self, spec: Any, env: settings.Settings) -> Entry:
        """A first call's work: every check, the group context, the path, the plan and the communicator."""

    def call(self, spec: Any, entry: Entry, env: settings.Settings) -> Call:
        """The value the communicator runs."""


def execute(kind: Kind, spec: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run one call of any op (see the module docstring); returns the communicator's ``(result, extra)``."""
    env = settings.current()
    every = env.agreement is None and agree_every_call(spec.a, spec.path, spec.group)
    lanes = env.replay and env.agreement is None and not every
    lane_key = None
    if lanes and REGISTRY.lanes:  # (no lane held: none to find, and the key's few microseconds are not spent)
        # The replay lane: a call that reads the same tensors as one its communicator replayed (the lane's key holds
        # the call's signature, so the group agreed on it and the registry resolved it) is one lookup, its outputs'
        # allocation and its graph's launch (``comm/replay.CallGraphs.replayer``): outside a capture, on the device.
        lane_key = kind.lane_key(spec, env)
        lane = None if lane_key is None else REGISTRY.lanes.get(lane_key)
        if lane is not None and guards.on_current_device(spec.a) and not guards.capturing(spec.a):
            try:
                done = lane(spec)
            except (RuntimeError, dist.DistBackendError) as exc:
                agreement.reraise(exc, spec.name, spec.group, env)
                raise
            if done is not None:
                return done
    if env.agreement is not None or every:  # before any collective of the call (plan lookups may run some)
        kind.agree(spec, env.timeout)  # the debug deadline; else (no switch, DETAIL) the group's own timeout
    signature = kind.signature(spec, env)
    entry = None if signature is None else REGISTRY.lookup(signature)
    if entry is None:
        if env.agreement is None and not every:  # no switch set: a call the group has not agreed on yet
            kind.agree(spec, None, once=True)
        entry = kind.resolve(spec, env)
        if signature is not None:
            REGISTRY.store(signature, entry)
    call = kind.call(spec, entry, env)
    communicator, a = entry[0], spec.a
    try:
        # A bare call names a's device in all it allocates and has no stream of its own; a hook is arbitrary code.
        if entry[2] and call.hook is None or guards.on_current_device(a):
            result = communicator.run(call)
        else:
            with torch.cuda.device(a.device):  # the communicator's streams and allocations on the tensors' device
                result = communicator.run(call)
    except (RuntimeError, dist.DistBackendError) as exc:
        agreement.reraise(exc, spec.name, spec.group, env)
        raise
    if lanes and call.replay:  # the call passed its checks; a lane key implies its signature
        lane = communicator.replayer(call)
        if lane is not None:
            lane_key = kind.lane_key(spec, env) if lane_key is None else lane_key
            if lane_key is not None:
                REGISTRY.store_lane(lane_key, lane)
    return result


# -- the tensor-parallel ops ---------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)  # not frozen: a frozen dataclass's __init__ costs microseconds on every call
class GemmSpec:
    """One call of a tensor-parallel op: ``name`` (the public op, for messages), ``op`` (the plan kind:
    ``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``), the operands, the group (None: the default), the plan
    (None: the library's) and path the caller asked for; ``return_gathered``: all-gather also returns its gathered
    input; ``hook``: independent work the call may overlap (``comm/protocol.Hook``); ``scales``: an fp8 call's
    scales, output dtype and bias (``comm/scaled.Scales``), None in bf16/fp16/fp32."""

    name: str
    op: str
    a: torch.Tensor
    b: torch.Tensor
    group: dist.ProcessGroup | None = None
    plan: Plan | None = None
    path: str = "auto"
    return_gathered: bool = False
    hook: Hook | None = None
    scales: Scales | None = None


_GEMM_FIELDS = (("op", OPS), "a's rows M", "b's columns N", "K (a's columns, b's rows)",
                ("dtype of a and b", DTYPE_NAMES), ("path", policy.CALL_PATHS), "plan (a digest; 0: none)",
                ("scaling (the scales' shapes)", ("none", *Scales.MODES)), ("out_dtype", DTYPE_NAMES))


class GemmKind:
    """The tensor-parallel ops' strategy: plans from ``runtime/plans.py``, communicators of kind ``"gemm"``."""

    def agree(self, spec: GemmSpec, timeout: float | None, once: bool = False) -> None:
        m, n, k = _checked(spec)
        if spec.path not in policy.CALL_PATHS:
            return  # resolve raises the clear error
        context = group_context(spec.name, spec.group, spec.a.device)
        if guards.capturing():
            return
        scales = spec.scales
        row = [OPS.index(spec.op), m, n, k, DTYPE_CODES[spec.a.dtype], policy.CALL_PATHS.index(spec.path),
               0 if spec.plan is None else agreement.digest(spec.plan),
               0 if scales is None else 1 + Scales.MODES.index(scales.mode),
               0 if scales is None else DTYPE_CODES[scales.out_dtype]]
        agreement.agree(spec.name, context, "gemm", _GEMM_FIELDS, row, timeout, once=once)

    def signature(self, spec: GemmSpec, env: settings.Settings) -> tuple | None:
        a, b, plan, group, scales = spec.a, spec.b, spec.plan, spec.group, spec.scales
        if type(a) is not torch.Tensor or type(b) is not torch.Tensor or (plan is not None and type(plan) is not Plan):
            return None
        if scales is not None and (type(scales.a) is not torch.Tensor or type(scales.b) is not torch.Tensor
                                   or scales.bias is not None and type(scales.bias) is not torch.Tensor):
            return None  # not cacheable: the first call's checks name the argument (a Python float scale, say)
        return (spec.op, spec.name, a.shape, b.shape, a.dtype, b.dtype, a.device, b.device, resolved_group(group),
                plan, spec.path, env.nccl_p2p_disabled, None if scales is None else scales.signature())

    def lane_key(self, spec: GemmSpec, env: settings.Settings) -> tuple | None:
        a, b, plan, group, scales = spec.a, spec.b, spec.plan, spec.group, spec.scales
        if (spec.hook is not None or type(a) is not torch.Tensor or type(b) is not torch.Tensor
                or plan is not None and type(plan) is not Plan):
            return None  # a hook's work is its own (a held hook's tensors are in the communicator's signature)
        fp8 = None
        if scales is not None:
            scale_a, scale_b, bias = scales.a, scales.b, scales.bias
            if (type(scale_a) is not torch.Tensor or type(scale_b) is not torch.Tensor
                    or bias is not None and type(bias) is not torch.Tensor):
                return None
            fp8 = (scales.mode, scales.out_dtype, laid_out(scale_a), laid_out(scale_b),
                   None if bias is None else laid_out(bias))
        return (spec.op, spec.name, a.data_ptr(), a.shape, a.stride(), a.dtype, a.device, b.data_ptr(), b.shape,
                b.stride(), b.dtype, b.device, resolved_group(group), plan, spec.path, spec.return_gathered,
                env.nccl_p2p_disabled, fp8)

    def resolve(self, spec: GemmSpec, env: settings.Settings) -> Entry:
        path, context, plan = resolve(spec, env.nccl_p2p_disabled)
        bare = plan.sequential and path != "reference"  # waits on nothing: no deadline
        return context.communicator("gemm", "sequential" if bare else path), plan, bare

    def call(self, spec: GemmSpec, entry: Entry, env: settings.Settings) -> Call:
        _, plan, bare = entry
        capturing = guards.capturing(spec.a)
        if capturing:  # a user's capture: waits as graph edges where one hardware queue serves every stream
            plan = policy.captured_plan(plan, env.single_queue)
        return Call(spec.name, plan, spec.a, spec.b, spec.return_gathered, spec.hook,
                    None if capturing or bare else env.timeout, env.replay and not capturing, spec.scales)


GEMM = GemmKind()


def laid_out(tensor: torch.Tensor) -> tuple:
    """Where a tensor lies, how it is laid out, of what and on which device: a lane key's part."""
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device


def _checked(spec: GemmSpec) -> tuple[int, int, int]:
    """The operand checks of a call: ``(M, N, K)`` (all-gather: this rank's shard rows), scales and plan included."""
    if spec.plan is not None and not isinstance(spec.plan, Plan):
        raise TypeError(f"{spec.name}: plan must be a flashoverlap.Plan, got {type(spec.plan).__name__}")
    if spec.scales is None:
        return check_operands(spec.name, spec.a, spec.b, "a_shard" if spec.op == "all_gather" else "a")
    return check_scaled(spec.name, spec.a, spec.b, spec.scales, spec.op)


def resolve(spec: GemmSpec, nccl_p2p_disabled: bool = False) -> tuple[str, GroupContext, Plan]:
    """Check a call and return its path, group context and plan (a first call's work: ``execute`` runs a repeated
    call from the registry without it)."""
    name, op, a, plan, path = spec.name, spec.op, spec.a, spec.plan, spec.path
    m, n, k = _checked(spec)  # for all-gather, m is this rank's shard
    context = group_context(name, spec.group, a.device)
    key = (op, a.dtype, m, n, k, path, plan is None, None if spec.scales is None else spec.scales.mode)
    seen = context.calls.get(key)
    world_size = context.world_size
    if op == "all_gather":
        m *= world_size  # a is this rank's shard: the plan is for the gathered M
    if seen is not None:
        default, path = seen
        if plan is not None:  # a given plan is checked against the path on every call (plans may differ)
            path = plans.given_plan_path(name, key[5], context, a, plan, nccl_p2p_disabled)
    else:
        if op == "reduce_scatter" and m % world_size:
            raise ValueError(
                f"{name}: a has M = {m} rows, which the {world_size} ranks of group cannot share evenly: "
                "reduce-scatter gives each rank M / world_size rows (pad M to a multiple of the world size)"
            )
        path, default = plans.path_and_plan(spec, (m, n, k), context, nccl_p2p_disabled)
        if len(context.calls) > REGISTRY.LIMIT:
            context.calls.clear()
        context.calls[key] = (default, path)
    plan = default if plan is None else plan
    if (plan.op, plan.m, plan.n, plan.k, plan.world_size) != (op, m, n, k, world_size):
        raise ValueError(
            f"{name}: plan is for {plan.op} (m, n, k) = {(plan.m, plan.n, plan.k)} over {plan.world_size} ranks, "
            f"but this call is {op} {(m, n, k)} over {world_size} ranks"
        )
    if (spec.scales is not None and spec.scales.mode == "block" and path == "nccl" and not plan.sequential
            and plan.gemm == "triton" and plan.tile.block_k != scaled.BLOCK):
        raise ValueError(f"{name}: block-wise scales need the plan's tile.block_k = {scaled.BLOCK} (one K slab per "
                         f"scale), got {plan.tile.block_k}: build the plan with tile=TileConfig(..., block_k="
                         f"{scaled.BLOCK}, ...) or pass none")
    if path == "nccl" and not plan.sequential and plan.gemm == "triton":
        room, need = guards.shared_memory(a.device), plan.tile.shared_bytes(a.element_size())
        if room is not None and need + SHARED_SLACK > room:
            whose, fix = (("the plan's", "pass a plan built for this dtype (an fp8 tile holds one-byte operands), "
                           "fewer stages or a smaller tile, or no plan") if spec.plan is not None else
                          ("the default plan's", "this GPU has less shared memory than the Hopper GPUs the defaults "
                           "are made for: pass a plan with fewer stages or a smaller tile, or path='p2p'"))
            raise ValueError(f"{name}: {whose} tile {plan.tile} needs about {need} bytes of shared memory a program "
                             f"with {a.dtype} operands, and this GPU gives a program {room}: {fix}")
    return path, context, plan
