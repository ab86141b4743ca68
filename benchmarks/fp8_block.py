"""The transformer block of ``benchmarks/block.py`` in float8 (torchao), sharded five ways, and its benchmark.

The block is ``block.Block`` (Llama-style, sequence parallel at ``W`` ranks, tokens split over the ranks between the
projections) with its four linears converted by torchao's ``convert_to_float8_training`` (a recipe of
``Float8LinearConfig.from_recipe_name``: ``tensorwise`` or ``rowwise``), then sharded by ``parallelize_module`` with
the plan ``qkv``, ``gate_up``: colwise, input ``Shard(0)`` (rank r's tokens, gathered); ``o``, ``down``: rowwise,
output ``Shard(0)``. The fused projections' rows are laid out rank-major first (rank r's q, k, v; rank r's gate,
up), so that PyTorch's contiguous ``Shard(0)`` of the weight gives rank r its own heads and FFN columns. A fused qkv
(gate_up) is one colwise linear whose input gather is the one torchtitan shares between wq, wk, wv through
``PrepareFloat8ModuleInput``: that style is not needed here (and would take the gather out of flashoverlap's
overlapped op). The figures (``FIGURES``):

- ``t_torch_*``: torchao's own styles (``torchao.float8.float8_tensor_parallel``), eager and compiled (the
  compiled one is the baseline);
- ``t_async_tp_ms``: torchtitan's async TP recipe: the same, compiled with Inductor's micro-pipeline TP pass
  (``_micro_pipeline_tp``) and symmetric memory enabled for the group (``enable_symm_mem_for_group``);
- ``t_ours_*``: flashoverlap's drop-ins ``flashoverlap.nn.Float8ColwiseParallel`` / ``Float8RowwiseParallel``,
  eager and compiled;
- ``t_pass_ms``: torchao's styles compiled with flashoverlap's compiler pass (``flashoverlap.compile``) on while
  it compiles; the row's ``rewrites`` are the patterns it rewrote for that row (``rewrite_counts()``, forward and
  backward);
- ``t_nocomm_*``: block.py's bound carried to float8: rank r's shard with each projection a local ``Float8Linear``
  of the shard's weight, the gather replaced by ``repeat`` and the reduce-scatter by a row slice. Its casts are the
  unsharded ``Float8Linear``'s (the recipe's), without the amax all-reduces; torchao's styles cast the input and the
  output gradient tensor-wise whatever the recipe: under the rowwise recipe the bound's casts differ from the
  baseline's.

Modes: a training step (forward and backward of a mean-square loss) and prefill (forward, no grad), at 8192 tokens
by default; bf16 model. ``E_block`` per row, as block.py's ``e_block`` (eager with eager, compiled with compiled).

On two GPUs, from the root of a source checkout::

    FLASHOVERLAP_COMMIT=$(git rev-parse HEAD) torchrun --nproc-per-node 2 -m benchmarks.fp8_block

writes ``benchmarks/results/<gpu>x2-<setting>-fp8-block.json`` (``NCCL_P2P_DISABLE=1``: the pcie-like setting).
``python -m benchmarks.fp8_block --dry-run`` (no GPU) runs ``dry_run`` at two gloo ranks: toy sizes, every variant
built and stepped once (stand-in timers), async TP skipped; prints the rows.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.block import TOY, Block, BlockConfig, TPBlock, _column_shard, _Shard, _time, e_block, time_row

RECIPES = ("tensorwise", "rowwise")

# Each figure: which block, compiled or not.
FIGURES = {
    "t_torch_eager_ms": ("torchao", False),
    "t_nocomm_eager_ms": ("nocomm", False),
    "t_ours_eager_ms": ("ours", False),
    "t_torch_compiled_ms": ("torchao", True),
    "t_nocomm_compiled_ms": ("nocomm", True),
    "t_async_tp_ms": ("async_tp", True),
    "t_ours_compiled_ms": ("ours", True),
    "t_pass_ms": ("pass", True),
}
NOT_ON_CPU = "not run on CPU (symmetric memory and Inductor's micro-pipeline TP need CUDA)"


def _rank_major(block: Block, world: int) -> Block:
    """A copy of ``block`` with the fused projections' rows rank-major (rank 0's q, k, v, then rank 1's...; the same
    for gate, up): a contiguous ``Shard(0)`` of the weight is then rank r's heads and FFN columns."""
    cfg, hd = block.cfg, block.cfg.head_dim
    full = copy.deepcopy(block)
    with torch.no_grad():
        for name, sizes in (("qkv", [cfg.heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]),
                            ("gate_up", [cfg.ffn, cfg.ffn])):
            weight = getattr(block, name).weight
            getattr(full, name).weight.copy_(torch.cat([_column_shard(weight, sizes, r, world)
                                                        for r in range(world)]))
    return full


def float8_tp_block(block: Block, recipe: str, mesh, styles) -> nn.Module:
    """``block`` in float8 (``recipe``), sharded over ``mesh`` by ``styles`` (a module with ``Float8ColwiseParallel``
    and ``Float8RowwiseParallel``: torchao's ``float8_tensor_parallel`` or ``flashoverlap.nn``), sequence parallel:
    rank r's ``x_r [T/W, hidden] -> [T/W, hidden]``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    world = mesh.size()
    model = convert_to_float8_training(_rank_major(block, world),
                                       config=Float8LinearConfig.from_recipe_name(recipe))
    col, row = styles.Float8ColwiseParallel, styles.Float8RowwiseParallel
    parallelize_module(model, mesh, {"qkv": col(input_layouts=Shard(0)), "o": row(output_layouts=Shard(0)),
                                     "gate_up": col(input_layouts=Shard(0)), "down": row(output_layouts=Shard(0))})
    model.heads, model.kv_heads = block.cfg.heads // world, block.cfg.kv_heads // world
    return model


class _Float8Local(nn.Module):
    """block.py's ``"nocomm"`` projection in float8: a local ``Float8Linear`` of the shard's weight, the gather
    replaced by ``repeat``, the reduce-scatter by a row slice."""

    def __init__(self, shard: _Shard, config) -> None:
        super().__init__()
        from torchao.float8.float8_linear import Float8Linear

        out_f, in_f = shard.weight.shape
        linear = nn.Linear(in_f, out_f, bias=False, device=shard.weight.device, dtype=shard.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(shard.weight)
        self.linear = Float8Linear.from_float(linear, config=config)
        self.column, self.world = shard.column, shard.world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.column:
            return self.linear(x.repeat(self.world, 1))
        y = self.linear(x)
        return y[: y.shape[0] // self.world]


def float8_nocomm_block(block: Block, recipe: str) -> nn.Module:
    """Rank r's shard of ``block`` in float8 with no communication (the bound; see the module's doc)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    model = TPBlock(block, impl="nocomm")
    for name in ("qkv", "o", "gate_up", "down"):
        setattr(model, name, _Float8Local(getattr(model, name), config))
    return model


@contextlib.contextmanager
def _with_pass():
    """flashoverlap's compiler pass on, with Inductor's and AOTAutograd's caches off (a cached graph would skip
    the pass, and its rewrites would go uncounted)."""
    import flashoverlap.compile as fc

    with fc.enabled(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def bench_rows(cfg: BlockConfig, token_counts: list[int], steps: int, recipes, compile_blocks: bool,
               async_tp: bool, log, *, dtype: torch.dtype = torch.bfloat16, backend: str = "inductor",
               pass_backend: str = "inductor", time_step=_time, skipped: dict[str, str] | None = None) -> list[dict]:
    """One row per recipe, token count and mode with every figure of ``FIGURES`` (None where skipped, and why in
    ``notes``: ``skipped`` names figures not built, with the reason); ``log(rows)`` after each row. On the current
    CUDA device, or on the CPU where the group is gloo (``time_step`` then a stand-in)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import float8_tensor_parallel as torchao_styles

    import flashoverlap.compile as fc
    import flashoverlap.nn as fnn

    world = dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    skipped = dict(skipped or {})
    if not compile_blocks:
        skipped.update({name: "--no-compile" for name, (_, compiled) in FIGURES.items() if compiled})
    elif not async_tp:
        skipped.setdefault("t_async_tp_ms", "--no-async-tp")
    rows: list[dict] = []
    for recipe in recipes:
        torch.manual_seed(0)
        block = Block(cfg, device=device, dtype=dtype)
        eager = {"torchao": float8_tp_block(block, recipe, mesh, torchao_styles),
                 "ours": float8_tp_block(block, recipe, mesh, fnn), "nocomm": float8_nocomm_block(block, recipe)}
        models: dict[str, nn.Module | None] = dict.fromkeys(FIGURES)
        for name, (impl, compiled) in FIGURES.items():
            if name in skipped:
                continue
            if not compiled:
                models[name] = eager[impl]
            elif impl == "async_tp":
                from torch.distributed._symmetric_memory import enable_symm_mem_for_group

                # torchtitan's maybe_enable_async_tp: symmetric memory for the TP group (deprecated in newer torch,
                # where it is no longer needed) and Inductor's _micro_pipeline_tp, here for this compile only.
                enable_symm_mem_for_group(mesh.get_group().group_name)
                models[name] = torch.compile(float8_tp_block(block, recipe, mesh, torchao_styles), fullgraph=True,
                                             backend=backend, **({"options": {"_micro_pipeline_tp": True}}
                                                                 if backend == "inductor" else {}))
            elif impl == "pass":
                models[name] = torch.compile(float8_tp_block(block, recipe, mesh, torchao_styles), fullgraph=True,
                                             backend=pass_backend)
            else:
                models[name] = torch.compile(eager[impl], fullgraph=True, backend=backend)
        del block
        with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
            for tokens in token_counts:
                x = torch.randn(tokens // world, cfg.hidden, device=device, dtype=dtype)
                for mode in ("train", "prefill"):
                    before = Counter(fc.rewrite_counts())
                    row = time_row(models, mode, tokens, x, steps, time_step, contexts={"t_pass_ms": _with_pass})
                    rewrites = Counter(fc.rewrite_counts())
                    rewrites.subtract(before)
                    counted = models["t_pass_ms"] is not None
                    row = {"recipe": recipe, **row,
                           "rewrites": {op: n for op, n in rewrites.items() if n} if counted else None}
                    for name, why in skipped.items():
                        row.setdefault("notes", {})[name] = why
                    row["E_block"] = _gains(row)
                    rows.append(row)
                    log(rows)
        del models, eager
    return rows


def _gains(row: dict) -> dict[str, float | None]:
    """block.py's ``E_block`` for each overlapped figure: ours eager against the eager baseline and bound, ours
    compiled, async TP and the pass against the compiled ones."""
    return {"ours_eager": e_block(row, False), "ours_compiled": e_block(row, True),
            "async_tp": e_block(row, True, impl="async_tp"),
            "pass": e_block({**row, "t_ours_compiled_ms": row.get("t_pass_ms")}, True)}


def _versions() -> dict:
    import importlib.metadata

    return {"torchao": importlib.metadata.version("torchao")}


# -- the dry run on the CPU ------------------------------------------------------------------------------------------
def dry_run(rank: int, world: int, recipes=RECIPES, tokens: int = 32, backend: str = "aot_eager",
            pass_backend: str = "inductor", command: str = "dry_run") -> tuple[list[dict], dict]:
    """The benchmark's loop on gloo ranks at toy sizes (bf16): every variant but async TP built and stepped once in
    each mode (forward and backward, forward alone) by a stand-in timer that returns 1.0 ms; compiled ones with
    ``backend`` (``fullgraph=True``: ``"eager"`` checks that dynamo traces each block whole, ``"aot_eager"`` its
    backward too), the pass's with ``pass_backend`` (the pass runs only under ``"inductor"``: then ``rewrites`` counts
    it). Returns the rows and the results' meta.

    torchao's styles all-gather fp8, which gloo does not carry: the test suite's ``_torchao_gathers_bytes``
    (``tests/nn/test_float8_styles.py``, so from a source checkout) makes torchao gather the same bytes as uint8."""
    import datetime

    import flashoverlap as fo
    from benchmarks.harness.run import commit
    from tests.nn.test_float8_styles import _torchao_gathers_bytes

    _torchao_gathers_bytes()

    def time_step(step, steps, warmup, host):
        step()  # one step (a compiled block's first: it compiles)
        host.append(0.0)
        return 1.0

    rows = bench_rows(TOY, [tokens], 1, recipes, True, False, lambda rows: None, backend=backend,
                      pass_backend=pass_backend, time_step=time_step, skipped={"t_async_tp_ms": NOT_ON_CPU})
    meta = {"gpus": f"{world}x cpu (dry run, gloo)", "world_size": world, "setting": "cpu-dry-run",
            "flashoverlap": fo.__version__, "torch": torch.__version__, **_versions(), "commit": commit(),
            "command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "recipes": list(recipes), "backend": backend, "pass_backend": pass_backend}
    return rows, meta


# -- the command line ------------------------------------------------------------------------------------------------
def _recipes(text: str) -> list[str]:
    import argparse

    names = [t for t in text.split(",") if t]
    if not names or any(n not in RECIPES for n in names):
        raise argparse.ArgumentTypeError(f"expected recipes among {','.join(RECIPES)}, got {text!r}")
    return names


def add_arguments(parser) -> None:
    from flashoverlap.cli import positive, positive_ints

    parser.add_argument("--recipe", type=_recipes, default=list(RECIPES), metavar="R,R",
                        help="torchao float8 recipes, comma-separated (default tensorwise,rowwise)")
    parser.add_argument("--tokens", type=positive_ints, default=[8192], metavar="T,T",
                        help="token counts (batch x sequence), comma-separated (default 8192)")
    parser.add_argument("--steps", type=positive, default=20, help="timed steps per figure, median (default 20)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled blocks")
    parser.add_argument("--no-async-tp", action="store_true", help="skip torchtitan's async TP recipe")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: two gloo ranks on the CPU at toy sizes, stand-in timers; prints the rows")
    parser.add_argument("--out", default=None,
                        help="results JSON (default benchmarks/results/<gpus>-<setting>-fp8-block.json)")


def _dry_main(args) -> int:
    import json

    from flashoverlap.bench import write_results
    from flashoverlap.testing import spawn

    command = "python -m benchmarks.fp8_block --dry-run"
    rows, meta = spawn(dry_run, 2, args=(args.recipe, 32, "aot_eager", "inductor", command))[0]
    print(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.out:
        write_results(args.out, meta, rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in argv:
        from flashoverlap.bench import out_problem

        parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8_block")
        add_arguments(parser)
        args = parser.parse_args(argv)
        # The dry run's sizes, steps and variants are its own (32 tokens, one step, every variant): the GPU run's
        # options would be ignored, and --out fail in the write after every variant ran.
        ignored = [opt for opt in ("--tokens", "--steps", "--no-compile", "--no-async-tp")
                   if any(arg == opt or arg.startswith(f"{opt}=") for arg in argv)]
        if ignored:
            parser.error(f"{', '.join(ignored)}: the GPU run's; --dry-run runs toy sizes, one step of every variant")
        problem = out_problem(args.out)
        if problem:
            parser.error(problem)
        return _dry_main(args)

    from benchmarks.harness.run import finish_run, start_run
    from flashoverlap.bench import write_results

    args, _, meta, out, _ = start_run("python -m benchmarks.fp8_block", __doc__.split("\n")[0], add_arguments, argv,
                                      "-fp8-block")
    meta.update({**_versions(), "recipes": args.recipe})

    def log(rows: list[dict]) -> None:
        if dist.get_rank() == 0:
            row = rows[-1]
            cells = " ".join(f"{k[2:-3]}={v:.2f}" for k, v in row.items() if k in FIGURES and v is not None)
            gains = " ".join(f"E_{k}={v:+.2f}" for k, v in row["E_block"].items() if v is not None)
            print(f"{row['recipe']:>10} {row['mode']:>8} {row['tokens']:>6} tokens: {cells} {gains} "
                  f"rewrites={row['rewrites']} {row.get('notes', '')}", flush=True)
            write_results(out, meta, rows)

    rows = bench_rows(BlockConfig(), args.tokens, args.steps, args.recipe, not args.no_compile,
                      not args.no_async_tp, log)
    return finish_run(out, meta, rows)


if __name__ == "__main__":
    raise SystemExit(main())
