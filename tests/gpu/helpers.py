"""What the GPU tests share: the skip condition, the environment for NCCL on shared machines, inputs, and the
comparison against plain PyTorch. The world size is FLASHOVERLAP_TEST_WORLD_SIZE if set, otherwise every GPU."""

import os

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def world_size(environ=os.environ) -> int:
    """FLASHOVERLAP_TEST_WORLD_SIZE (ASCII digits: one rank per GPU), else every GPU; anything else raises, naming
    the variable (``int()`` said only "invalid literal", from every GPU test module's collection)."""
    text = environ.get("FLASHOVERLAP_TEST_WORLD_SIZE", "")
    if text == "":
        return GPUS
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"FLASHOVERLAP_TEST_WORLD_SIZE must be a number of ranks (one per GPU), got {text!r}")
    return int(text)


WORLD = world_size()
needs_gpus = pytest.mark.skipif(
    GPUS < 2 or WORLD < 2 or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs 2 or more CUDA GPUs, and TRITON_INTERPRET unset (the kernels must be compiled)",
)
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

ODD_SHAPES = [(777, 2000, 1234), (1, 4096, 4096), (1000, 1000, 100), (1023, 1025, 1027), (3000, 4096, 520)]
ROUND_SHAPES = [(4096, 4096, 4096), (2048, 8192, 1024)]


def poison_allocator(device) -> None:
    """Fill free memory of the caching allocator with NaN so that an unwritten output element shows."""
    blocks = [torch.full((64 << 20,), float("nan"), dtype=torch.float16, device=device) for _ in range(8)]
    del blocks


def inputs(m, n, k, dtype, seed, transposed=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, dtype=dtype, device="cuda", generator=gen)
    if transposed:
        b = (torch.randn(n, k, dtype=dtype, device="cuda", generator=gen) / k**0.5).t()
    else:
        b = torch.randn(k, n, dtype=dtype, device="cuda", generator=gen) / k**0.5
    return a, b


def assert_close(got, want, what):
    assert not torch.isnan(got).any(), f"{what}: NaN in the output (an element was never written)"
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    limit = 1e-2 if got.dtype == torch.bfloat16 else 2e-3
    assert err < limit, f"{what}: relative error {err:.2e} >= {limit}"


def check_graph_replays(call, expected, a, b, rank, replays):
    """Capture ``out = call(a, b)`` in a CUDA graph (after one eager call: NCCL state, compile, tables), then
    replay it ``replays`` times on fresh values of ``a`` with the output poisoned, each against ``expected``."""
    call(a, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        out = call(a, b)
    torch.cuda.current_stream().wait_stream(side)
    for r in range(replays):
        gen = torch.Generator(device="cuda").manual_seed(1000 * r + rank)
        a.copy_(torch.randn(a.shape, dtype=a.dtype, device="cuda", generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        assert_close(out, expected(a, b), f"graph replay {r}")
    return replays


def relative_close(got, want, what, limit):
    """``got``'s normwise relative error against ``want`` under ``limit``; a NaN (an element never written) fails."""
    assert not torch.isnan(got.float()).any(), f"{what}: NaN in the output (an element never written)"
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert err < limit, f"{what}: relative error {err:.2e}"


def communicator_graphs(kind: str, path: str):
    """The current CUDA device and the replay graphs (``comm/replay.CallGraphs``) of the default group's ``(kind,
    path)`` communicator on it: what a replay test counts."""
    import torch.distributed as dist

    from flashoverlap.runtime.context import context_of

    device = torch.device("cuda", torch.cuda.current_device())
    return device, context_of(dist.group.WORLD, device).communicator(kind, path).graphs
