"""The direct launcher (``kernels/launch.py``): a launch reuses a compiled kernel only for the same fingerprint, and
hands its launcher the arguments the JIT would (the positional ones, then every constexpr in declaration order)."""

import inspect

import pytest
import torch

from flashoverlap import guards
from flashoverlap.kernels import launch
from flashoverlap.kernels.launch import Launcher, fingerprint


class _Compiled:
    """A compiled kernel's surface as the JIT returns it: ``run`` takes the grid, stream, function, metadata, hooks,
    then every bound argument."""

    function = "cufunction"
    packed_metadata = ("packed",)

    def __init__(self):
        self.launches = []

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter, exit_, *args):
        self.launches.append(((g0, g1, g2), stream, function, packed, args))


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Kernel:
    """A ``triton.jit`` function's surface: ``kernel[grid](*args, **meta)`` compiles (once per call here: the test
    counts them) and returns the compiled kernel."""

    arg_names = ["x", "y", "n", "BLOCK", "FLAG", "EVEN"]
    params = [_Param("x"), _Param("y"), _Param("n"), _Param("BLOCK"), _Param("FLAG"), _Param("EVEN", True)]

    def __init__(self):
        self.jit_calls = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.jit_calls.append((grid, args, meta))
            compiled = _Compiled()
            self.last = compiled
            return compiled
        return run


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(guards, "triton_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    if launch._knobs is None:
        pytest.skip("Triton < 3.4: no direct launches")
    return _Kernel()


def test_a_repeated_launch_skips_the_jit_and_passes_what_the_jit_would(kernel):
    launcher = Launcher(kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    meta = {"BLOCK": 32, "FLAG": False, "num_warps": 4}
    launcher(5, (x, y, 64), meta)
    assert len(kernel.jit_calls) == 1 and launcher.fast_launches == 0
    compiled = kernel.last
    x2, y2 = torch.ones(64), torch.ones(64)  # other tensors, same dtype and alignment
    launcher(5, (x2, y2, 64), meta)
    assert len(kernel.jit_calls) == 1 and launcher.fast_launches == 1
    grid, stream, function, packed, args = compiled.launches[0]
    assert grid == (5, 1, 1) and stream == 1234 and function == "cufunction" and packed == ("packed",)
    assert args[:3] == (x2, y2, 64) and args[3:] == (32, False, True)  # the constexprs, the default last


@pytest.mark.parametrize("change", ["alignment", "dtype", "integer", "constexpr", "option"])
def test_a_launch_with_another_fingerprint_goes_through_the_jit(kernel, change):
    launcher = Launcher(kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    meta = {"BLOCK": 32, "FLAG": False, "num_warps": 4}
    launcher(5, (x, y, 64), meta)
    args, meta2 = (x, y, 64), dict(meta)
    if change == "alignment":
        args = (x[1:], y, 64)  # 4 bytes off: no longer 16-byte aligned
    elif change == "dtype":
        args = (x.half(), y, 64)
    elif change == "integer":
        args = (x, y, 63)  # another class: 64 is a multiple of 16, 63 is not
    elif change == "constexpr":
        meta2["FLAG"] = True
    else:
        meta2["num_warps"] = 8
    launcher(5, args, meta2)
    assert len(kernel.jit_calls) == 2 and launcher.fast_launches == 0


def test_interpreted_kernels_always_go_through_the_jit(kernel, monkeypatch):
    monkeypatch.setattr(guards, "triton_interpreted", lambda: True)
    launcher = Launcher(kernel)
    x = torch.zeros(64)
    for _ in range(3):
        launcher(1, (x, x, 64), {"BLOCK": 32, "FLAG": False})
    assert len(kernel.jit_calls) == 3 and launcher.fast_launches == 0


@pytest.mark.parametrize("hook", ["plain", "chain"])
def test_a_profiler_hook_sends_launches_through_the_jit(kernel, monkeypatch, hook):
    def enter(metadata):
        return None

    if hook == "chain":  # Triton >= 3.7: a chain of hooks, empty by default
        chain = type("HookChain", (), {"calls": [enter]})()
        monkeypatch.setattr(launch._knobs.runtime, "launch_enter_hook", chain)
    else:
        monkeypatch.setattr(launch._knobs.runtime, "launch_enter_hook", enter)
    launcher = Launcher(kernel)
    x = torch.zeros(64)
    for _ in range(2):
        launcher(1, (x, x, 64), {"BLOCK": 32, "FLAG": False})
    assert len(kernel.jit_calls) == 2


def test_fingerprints_name_what_specialises_a_kernel():
    x = torch.zeros(8)
    assert fingerprint(x) == (torch.float32, True)
    assert fingerprint(x[1:]) == (torch.float32, False)
    assert fingerprint(7) == fingerprint(9) != fingerprint(16)  # integers by class: width, == 1, % 16 == 0
    # Equal in a key, specialised apart by Triton (u1, constexpr 1, fp32).
    assert len({fingerprint(1), fingerprint(True), fingerprint(1.0)}) == 3
    with pytest.raises(TypeError, match="no fingerprint"):
        fingerprint(object())


def test_a_launchs_fingerprints_are_each_arguments_and_the_kept_integer_classes_are_bounded():
    """The launcher's own pass over the arguments (ints and plain tensors without a call each) gives what
    ``fingerprint`` gives argument by argument, integers by ``integer_class`` whether or not their class was kept; the
    classes kept by value never exceed their bound."""
    classes = launch.IntegerClasses(kept=8)
    x = torch.zeros(8)
    args = (x, x[1:], torch.nn.Parameter(x), 1, 7, 16, 2**31, 2**31 + 16, 2**63, -3, True, 1.0, None, "s",
            x.to(torch.float16), 7, 16, 2**31)
    want = tuple(launch.integer_class(v) if type(v) is int else fingerprint(v) for v in args)
    assert launch._fingerprints(args, classes) == want  # classes computed and kept
    assert launch._fingerprints(args, classes) == want  # classes read back
    assert all(type(key) is int for key in classes.by_value)  # a bool argument is fingerprint's (True == 1)
    for value in range(100):
        assert launch._fingerprints((value,), classes) == (launch.integer_class(value),)
        assert len(classes.by_value) <= 8
    assert launch._fingerprints(args) == want  # the launchers' own classes
    with pytest.raises(TypeError, match="no fingerprint"):
        launch._fingerprints((x, object()), classes)


def test_a_tensor_descriptors_fingerprint_holds_its_block_and_layout():
    descriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor
    a = torch.zeros(64, 64, dtype=torch.float16)
    base = fingerprint(descriptor.from_tensor(a, [16, 32]))
    assert fingerprint(descriptor.from_tensor(a, [16, 32])) == base
    assert fingerprint(descriptor.from_tensor(a, [32, 32])) != base  # another block shape
    assert fingerprint(descriptor.from_tensor(a[:32], [16, 32])) == base  # another shape of the same class
    assert fingerprint(descriptor.from_tensor(a[:33], [16, 32])) != base  # rows no longer a multiple of 16
    assert fingerprint(descriptor.from_tensor(a.float(), [16, 32])) != base  # another dtype


def test_a_gluon_descriptors_fingerprint_holds_its_shared_layout():
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    a = torch.zeros(64, 128, dtype=torch.float16)

    def described(swizzle):
        return hopper.TensorDescriptor(a, [64, 128], [128, 1], [64, 64], gl.NVMMASharedLayout(swizzle, 16, 2))

    assert fingerprint(described(128)) == fingerprint(described(128))
    assert fingerprint(described(64)) != fingerprint(described(128))  # the same block, another swizzle


def test_integers_of_one_class_are_one_specialisation_to_triton():
    """The classes are never looser than Triton's own specialisation (``native_specialize_impl`` with the CUDA
    backend's hints): two integers of one class specialise alike, so a compiled kernel is reused only where the JIT
    would reuse it; and a row count that changes within its class keeps launching directly."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    backend = pytest.importorskip("triton.backends.nvidia.compiler").CUDABackend
    values = [0, 1, 2, 7, 15, 16, 17, 48, 4096, 4097, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 3, 2**40,
              2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    classes = {}
    for value in values:
        classes.setdefault(launch.integer_class(value), set()).add(native(backend, value, False, True, True))
    assert all(len(specialised) == 1 for specialised in classes.values()), classes
    assert len(classes) == 7  # 1; i32, i64 and u64, each a multiple of 16 or not


def test_a_new_row_count_of_a_known_class_launches_directly(kernel):
    launcher = Launcher(kernel)
    x = torch.zeros(64)
    meta = {"BLOCK": 32, "FLAG": False}
    for rows in (4096, 1232, 16, 4099, 77, 1):  # the JIT compiles for 4096 (D), 4099 (plain), 1 (a constant)
        launcher(1, (x, x, rows), meta)
    assert len(kernel.jit_calls) == 3 and launcher.fast_launches == 3 and launcher.launches == 6
    assert kernel.jit_calls[1][1][2] == 4099 and kernel.last.launches == []


@pytest.mark.parametrize("switch", ["debug", "pre-run hook", "exit hook"])
def test_the_jits_own_switches_are_honoured(kernel, monkeypatch, switch):
    launcher = Launcher(kernel)
    x = torch.zeros(64)
    launcher(1, (x, x, 64), {"BLOCK": 32, "FLAG": False})
    if switch == "debug":  # a debug build is another kernel: compiled through the JIT, then launched directly
        monkeypatch.setattr(launch._knobs.runtime, "debug", True)
    elif switch == "pre-run hook":
        kernel.pre_run_hooks = [lambda *args, **kwargs: None]
    else:
        monkeypatch.setattr(launch._knobs.runtime, "launch_exit_hook", lambda metadata: None)
    launcher(1, (x, x, 64), {"BLOCK": 32, "FLAG": False})
    assert len(kernel.jit_calls) == 2 and launcher.fast_launches == 0


@pytest.mark.parametrize("declared", [["n"], [2]])
def test_an_unspecialised_integer_shares_one_compiled_kernel_per_width(kernel, declared):
    """``do_not_specialize`` integers (the counter wait's group index and value): every value that fits 32 bits
    reuses the kernel compiled for the first, as in the JIT, so a graph never captures a JIT launch for a new group;
    a 64-bit value is another kernel."""
    kernel.arg_names = ["x", "y", "n", "BLOCK", "FLAG", "EVEN"]
    kernel.do_not_specialize = declared  # as ``triton.jit(do_not_specialize=...)`` keeps it: names or positions
    launcher = Launcher(kernel)
    x = torch.zeros(64)
    meta = {"BLOCK": 32, "FLAG": False}
    for n in (0, 1, 16, 7, 2**31 - 1):
        launcher(1, (x, x, n), meta)
    assert len(kernel.jit_calls) == 1 and launcher.fast_launches == 4
    assert kernel.last.launches[-1][4][2] == 2**31 - 1  # the value itself still reaches the kernel
    launcher(1, (x, x, 2**40), meta)
    assert len(kernel.jit_calls) == 2
    assert launch.unspecialised(5) == launch.unspecialised(-(2**31)) != launch.unspecialised(2**31)
    assert launch.unspecialised(2**63) == (int, "u64")
    # Not integers: keyed as everything else is (Triton types a bool u1, a float fp32).
    assert launch.unspecialised(True) == fingerprint(True) != launch.unspecialised(1)
    assert launch.unspecialised(1.0) == fingerprint(1.0)
