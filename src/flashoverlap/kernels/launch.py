"""Launching a Triton kernel again without the JIT's per-launch work (host time: issue 41).

``kernel[grid](*args, **meta)`` binds every argument, computes its specialisation (each pointer's 16-byte
alignment, each integer's value class), builds a string cache key from it and looks the compiled kernel up, on every
launch. ``Launcher`` does that once per *fingerprint* and then calls the compiled kernel's launcher directly, with the
same argument list the JIT hands it. What that saves is measured beside the JIT's launch by
benchmarks/diagnostics/nccl_host_parts.py (benchmarks/results/h200x1-nccl-host-parts.json: a fraction of a launch,
whose larger part is the launcher's own work, the TMA descriptors it encodes among it).

The fingerprint is never looser than Triton's specialisation, so it can never reuse a kernel compiled for another
one: the device, every constexpr and launch option, each tensor's dtype and 16-byte alignment, each tensor
descriptor's dtype, block shape, padding, alignment, (Gluon's) shared layout and its shape's and strides' integer
classes, and every integer argument by its *class*: the width Triton types it by (i32, i64, u64), whether it is 1
(Triton makes that a constant) and whether it is a multiple of 16 (Triton's divisibility hint), which is all of an
integer Triton compiles into a kernel. So an exact-mode expert call, whose rows follow its routing and change every
call, still launches directly: a new row count of a known class finds its kernel here, as it does in the JIT's cache.
The key also holds the switches the JIT reads on every launch (``knobs.runtime.debug``, the instrumentation mode).
An integer the kernel declares ``do_not_specialize`` is keyed by its width class only (Triton compiles one kernel for
every value of it that fits 32 bits), so its values share one compiled kernel here as they do in the JIT.
Where Triton runs in its interpreter (the CPU tests), where a profiler hook asks for launch metadata, or where the
kernel has pre-run hooks, every launch goes through the JIT.
"""

from __future__ import annotations

import inspect

import torch

from flashoverlap import guards

try:
    from triton import knobs as _knobs
except ImportError:  # Triton < 3.4: the hooks live on CompiledKernel; the fast path is not taken there
    _knobs = None

LIMIT = 256  # fingerprints kept per kernel (a model has a few per layer shape; beyond that, start again)


def _width(value: int) -> object:
    """The type Triton gives a Python integer argument; beyond u64 (Triton refuses it) the value itself."""
    if -(2**31) <= value < 2**31:
        return "i32"
    if -(2**63) <= value < 2**63:
        return "i64"
    return "u64" if 0 <= value < 2**64 else value


def integer_class(value: int) -> tuple:
    """All of a specialised integer argument that a compiled kernel depends on: Triton's width, whether it is the
    constant 1, whether the divisibility-by-16 hint holds (``native_specialize_impl``: ``('constexpr', 1)``,
    ``('i32', 'D')``, ``('i64', '')``, ...)."""
    return int, _width(value), value == 1, value % 16 == 0


class IntegerClasses:
    """``integer_class`` by value, kept: a launch's integers (sizes, strides, row counts) take few distinct values, and
    a dict lookup is a fraction of ``integer_class``'s calls (host time: an fp8 expert call launches several kernels
    of twenty integers each). At most ``kept`` are kept; beyond that, start again."""

    __slots__ = ("kept", "by_value")

    def __init__(self, kept: int = 4096) -> None:
        self.kept = kept
        self.by_value: dict[int, tuple] = {}  # only ``int`` keys (a bool is never passed: True == 1)

    def __call__(self, value: int) -> tuple:
        found = self.by_value.get(value)
        if found is None:
            if len(self.by_value) >= self.kept:
                self.by_value.clear()
            found = self.by_value[value] = integer_class(value)
        return found


INTEGER_CLASSES = IntegerClasses()  # the launchers' own


def unspecialised(value: object) -> object:
    """A ``do_not_specialize`` integer's fingerprint: the width Triton types it by (i32, i64, u64), not its value;
    anything else (a bool, a float, a tensor) as ``fingerprint`` keys it, and an integer beyond u64 by value (Triton
    refuses it)."""
    if type(value) is not int:
        return fingerprint(value)
    return int, _width(value)


def fingerprint(value) -> object:
    """What of one argument the compiled kernel depends on, beyond the values it reads at run time."""
    if isinstance(value, torch.Tensor):  # the device is the key's (the current one, where the kernel runs)
        return value.dtype, value.data_ptr() % 16 == 0
    if type(value) is int:
        return INTEGER_CLASSES(value)
    if value is None or isinstance(value, (bool, float, str)):
        return type(value), value  # in a key True == 1 == 1.0; Triton specialises them apart
    base = getattr(value, "base", None)  # a host tensor descriptor
    if isinstance(base, torch.Tensor):  # Triton keys only its dtype and block (and layout); the rest is kept, by class
        return (type(value), base.dtype, base.device, base.data_ptr() % 16 == 0, tuple(value.block_shape),
                tuple(map(INTEGER_CLASSES, value.shape)), tuple(map(INTEGER_CLASSES, value.strides)),
                getattr(value, "padding", None), getattr(value, "layout", None))  # Gluon's shared layout (hashable)
    raise TypeError(f"Launcher: no fingerprint for an argument of type {type(value).__name__}")


class Launcher:
    """``kernel[(grid,)](*args, **meta)``, issued through the compiled kernel's launcher once the JIT has compiled
    and launched it for the same fingerprint. ``args``: the kernel's leading positional arguments; ``meta``: its
    constexprs by name and the launch options (``num_warps``, ``num_stages``). The arguments the kernel declares
    ``do_not_specialize`` (by name or position) are keyed by ``unspecialised``."""

    def __init__(self, kernel, limit: int = LIMIT) -> None:
        self.kernel = kernel
        self.limit = limit
        self._compiled: dict[tuple, tuple] = {}  # fingerprint -> (compiled kernel, the constexprs' values in order)
        names = list(getattr(kernel, "arg_names", ()))
        params = getattr(kernel, "params", ())
        self._tail_names = names
        self._by_width = frozenset(names.index(arg) if isinstance(arg, str) else arg
                                   for arg in getattr(kernel, "do_not_specialize", None) or ())
        self._defaults = {p.name: p.default for p in params
                          if getattr(p, "default", inspect.Parameter.empty) is not inspect.Parameter.empty}
        self.launches = 0  # every launch through this launcher, direct or through the JIT
        self.fast_launches = 0  # the direct ones

    def __call__(self, grid: int, args: tuple, meta: dict) -> None:
        self.launches += 1
        if guards.triton_interpreted() or _hooked() or getattr(self.kernel, "pre_run_hooks", None):
            self.kernel[(grid,)](*args, **meta)
            return
        device = torch.cuda.current_device()
        # The switches the JIT folds into its own key on every launch (a debug build, instrumentation).
        switches = (_knobs.runtime.debug, getattr(_knobs.compilation, "instrumentation_mode", None))
        if self._by_width:
            prints = tuple(unspecialised(value) if i in self._by_width else fingerprint(value)
                           for i, value in enumerate(args))
        else:
            prints = _fingerprints(args)
        key = (device, switches, tuple(meta.items()), prints)
        hit = self._compiled.get(key)
        if hit is None:
            compiled = self.kernel[(grid,)](*args, **meta)
            if _knobs is not None and hasattr(compiled, "packed_metadata"):
                if len(self._compiled) >= self.limit:
                    self._compiled.clear()
                self._compiled[key] = (compiled, self._constexprs(len(args), meta))
            return
        compiled, tail = hit
        stream = torch._C._cuda_getCurrentRawStream(device)
        runtime = _knobs.runtime
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     runtime.launch_enter_hook, runtime.launch_exit_hook, *args, *tail)
        self.fast_launches += 1

    def _constexprs(self, positional: int, meta: dict) -> tuple:
        """The values the JIT binds to the parameters after the positional ones (constexprs, from ``meta`` or the
        kernel's defaults), in declaration order: the JIT passes every bound parameter to the launcher."""
        tail = []
        for name in self._tail_names[positional:]:
            if name in meta:
                tail.append(meta[name])
            elif name in self._defaults:
                tail.append(self._defaults[name])
            else:
                raise TypeError(f"Launcher: no value for the kernel's parameter {name}")
        return tuple(tail)


def _fingerprints(args: tuple, classes: IntegerClasses = INTEGER_CLASSES) -> tuple:
    """``tuple(map(fingerprint, args))``, with the two kinds most arguments are (an int, a plain tensor) looked at
    first, here, without a call each (host time, on every launch); integers through ``classes``."""
    prints = []
    append, known, tensor = prints.append, classes.by_value.get, torch.Tensor
    for value in args:
        kind = type(value)
        if kind is int:
            append(known(value) or classes(value))
        elif kind is tensor:
            append((value.dtype, value.data_ptr() % 16 == 0))
        else:
            append(fingerprint(value))
    return tuple(prints)


def _hooked() -> bool:
    """Whether a launch hook (a profiler's) wants each launch's metadata: Triton < 3.7 holds one hook or None, later
    ones a chain of hooks, empty by default."""
    if _knobs is None:
        return True
    hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    return any(hook is not None and bool(getattr(hook, "calls", True)) for hook in hooks)
