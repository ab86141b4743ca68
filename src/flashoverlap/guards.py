"""One helper per rule that every layer with GPU work obeys: the capture guard, the device check, the communication
streams' priority, the SM count, whether Triton interprets its kernels, the debug deadline and its poll. Nothing
else in the package spells these out."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

# The most negative priority, which CUDA clamps to the device's highest: communication streams run their work
# ahead of the GEMM's waves as soon as it is ready.
COMM_PRIORITY = -(1 << 10)
# Plans made where no GPU can be asked (the reference path, the CPU tests) assume an H200's SMs.
DEFAULT_SMS = 132


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream of the highest priority on ``device``."""
    return torch.cuda.Stream(device=device, priority=COMM_PRIORITY)


def capturing(operand: torch.Tensor | None = None) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never on a machine without CUDA). Given a
    call's ``operand``, a CPU tensor answers at once, and a CUDA tensor (CUDA is initialised) asks torch's C
    binding directly, without its Python wrapper: host time on every call."""
    if operand is not None:
        return operand.is_cuda and torch._C._cuda_isCurrentStreamCapturing()
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def on_current_device(operand: torch.Tensor) -> bool:
    """Whether ``operand`` lies on the current CUDA device, or on the CPU: a call's streams and allocations then
    need no device switch. Asked on every call, so through torch's C binding (CUDA is initialised where a tensor
    lives on it)."""
    return not operand.is_cuda or operand.get_device() == torch._C._cuda_getDevice()


def refuse_inside_capture(what: str) -> None:
    """Raise where ``what`` (a first call's set-up: allocations, collectives, kernel loads) would be captured."""
    if capturing():
        raise RuntimeError(
            f"flashoverlap: {what} and cannot be captured in a CUDA graph; call the op once, eagerly, with the "
            "same shapes before capturing"
        )


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of ``device`` (``DEFAULT_SMS`` off the GPU)."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def shared_memory(device: torch.device) -> int | None:
    """The shared memory one program may take on ``device`` (bytes, the opt-in limit: 232,448 on an H100 or H200);
    None off the GPU (no limit checked: the interpreter holds none)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``, the CPU tests): asked of Triton
    itself (``triton.knobs.runtime.interpret``), which reads the variable; False where Triton is not installed.
    Code that runs a kernel off the GPU asks this, and falls back to plain PyTorch where it is False."""
    try:
        import triton
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    from flashoverlap import settings  # an older Triton, which has no knobs: the variable, read once

    return settings.current().triton_interpret




def poll_until(ready: Callable[[], bool], deadline: float, failure: Callable[[], str]) -> None:
    """Poll ``ready()`` until it is true; past ``deadline`` (``time.monotonic``) raise ``failure()`` as a
    RuntimeError. The one deadline loop behind every debug-mode wait."""
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(failure())
        time.sleep(1e-4)


def poll_events(waited, timeout: float, failure: Callable[[object], str]) -> None:
    """Debug mode's check of a call's waits, after the call is issued: each ``(event, what)`` of ``waited`` (an
    event recorded after a wait, and what it waited for) must complete within ``timeout`` seconds of now, one
    deadline for them all; the first that does not raises ``failure(what)`` as a RuntimeError."""
    deadline = time.monotonic() + timeout
    for event, what in waited:
        poll_until(event.query, deadline, lambda what=what: failure(what))
