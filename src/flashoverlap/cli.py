"""The command line: ``python -m flashoverlap <command>`` (also installed as ``flashoverlap``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashoverlap", description="flashoverlap command line")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run one overlapped GEMM+AllReduce and check it against PyTorch")
    demo.add_argument("--m", type=int, default=None, help="rows of a (default 16384 on GPUs, 4096 on the CPU)")
    demo.add_argument("--n", type=int, default=None, help="columns of b (default 8192 / 4096)")
    demo.add_argument("--k", type=int, default=None, help="this rank's K (default 4096 / 1024)")
    demo.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    demo.add_argument("--world-size", type=int, default=None, help="ranks (default: all GPUs, or 2 on the CPU)")
    demo.add_argument("--cpu", action="store_true", help="use CPU processes even when GPUs are present")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from flashoverlap.demo import main as demo_main

        return demo_main(args.m, args.n, args.k, args.dtype, args.world_size, args.cpu)
    return 2


if __name__ == "__main__":
    sys.exit(main())
