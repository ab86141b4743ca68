"""Test tensor-parallel code at W = 8 on ONE GPU: ``flashoverlap.testing.spawn_on_one_gpu`` starts W processes on the
GPU over a gloo group, and flashoverlap's ops run their P2P path between them (the peers' memory mapped by CUDA
IPC). The code under test is a sequence-parallel MLP, column-parallel then row-parallel, checked against the
unsharded computation on every rank. The ranks share one GPU's SMs and copy engines: this tests the code, not its
speed.

    python examples/shared_gpu.py [--world 8]

Without a CUDA GPU it says so and exits non-zero. Started inside ranks that already form a group (the test suite's
CPU ranks), ``main()`` checks the same MLP on that group, with CPU-sized tensors (the reference path).
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashoverlap as fo
from flashoverlap.testing import spawn_on_one_gpu


def mlp(x_r, w1_r, w2_r, group=None):
    """Sequence-parallel MLP: ``x_r [T/W, H]`` (this rank's tokens) -> ``[T/W, H]``. ``w1_r [F/W, H]`` holds this
    rank's rows of the first weight (column-parallel), ``w2_r [H, F/W]`` its columns of the second (row-parallel)."""
    h = fo.all_gather_gemm(x_r, w1_r.t(), group)  # [T, F/W]: every rank's tokens, this rank's features
    return fo.gemm_reduce_scatter(F.gelu(h), w2_r.t(), group)  # [T/W, H]: summed over ranks, this rank's tokens


def check_rank(rank: int, world: int, on: str = "cpu") -> float:
    """One rank: the MLP on this rank's shards against the unsharded MLP, on the GPU (``on="cuda"``) or the CPU;
    returns the largest relative difference over the ranks."""
    device = torch.device("cuda", torch.cuda.current_device()) if on == "cuda" else torch.device("cpu")
    # Llama-3-8B's MLP with 8192 tokens on the GPU (large enough that every call overlaps); small on the CPU.
    T, H, FFN = (8192, 4096, 14336) if on == "cuda" else (16 * world, 64, 32 * world)
    torch.manual_seed(0)  # the same weights and tokens on every rank
    w1 = torch.randn(FFN, H, dtype=torch.bfloat16, device=device) / H**0.5
    w2 = torch.randn(H, FFN, dtype=torch.bfloat16, device=device) / FFN**0.5
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    want = (F.gelu(x @ w1.t()) @ w2.t()).chunk(world)[rank]  # the unsharded MLP, this rank's tokens
    x_r = x.chunk(world)[rank]
    w1_r = w1.chunk(world, dim=0)[rank].contiguous()
    w2_r = w2.chunk(world, dim=1)[rank].contiguous()
    got = mlp(x_r, w1_r, w2_r)
    diff = ((got.float() - want.float()).norm() / want.float().norm()).reshape(1).cpu()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # over gloo: a CPU tensor
    ok = diff.item() <= 2e-2
    if rank == 0:
        print(f"shared_gpu: {world} ranks on {device}, sequence-parallel MLP ({T}x{H}x{FFN}): max relative diff vs "
              f"the unsharded MLP {diff.item():.1e}, {'OK' if ok else 'MISMATCH'}", flush=True)
    assert ok, f"the MLP on {world} ranks differs from the unsharded MLP by {diff.item()}"
    return diff.item()


def main(world: int = 8) -> None:
    if dist.is_initialized():  # inside ranks that already form a group: check on it, as it is
        check_rank(dist.get_rank(), dist.get_world_size())
        return
    if not torch.cuda.is_available():  # one line, not a traceback
        sys.exit(f"{sys.argv[0]} needs a CUDA GPU: its ranks share one (found no CUDA GPUs)")
    diffs = spawn_on_one_gpu(check_rank, world, args=("cuda",))
    print(f"shared_gpu: every rank of {world} agrees with the unsharded MLP (max relative diff {max(diffs):.1e})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, read before the GPU is looked for: ``--help`` and a bad option answer on any machine."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8, choices=range(2, 9), metavar="{2..8}",
                        help="ranks on the GPU (2 to 8)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    world = parse_args().world
    if not torch.cuda.is_available():  # one line, not a traceback
        sys.exit(f"{sys.argv[0]} needs a CUDA GPU: its ranks share one (found no CUDA GPUs)")
    main(world)
