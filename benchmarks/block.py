"""A Llama-style decoder block at tensor parallelism with sequence parallelism, five ways, and its benchmark.

The block (``Block``, unsharded): ``h = x + o(attn(qkv(rms_norm(x))))``, ``y = h + down(silu(gate(n)) * up(n))``
with ``n = rms_norm(h)``, causal SDPA with grouped KV heads. ``TPBlock`` is rank r's shard of it over ``W`` ranks,
tokens split over the ranks between the projections (sequence parallelism): ``x_r [T/W, hidden]`` -> ``y_r [T/W,
hidden]``. qkv and gate/up are column-parallel (rank r: its heads, its FFN columns), o and down row-parallel.
How the projections communicate (``impl``):

- ``"ours"``: ``flashoverlap.nn.ColumnParallelLinear`` / ``RowParallelLinear`` (``all_gather_gemm``,
  ``gemm_reduce_scatter`` and their overlapped backwards);
- ``"torch"``: plain PyTorch TP, matmul then NCCL (``torch.distributed._functional_collectives``, differentiable),
  which torch's async TP (the Inductor micro-pipeline pass) rewrites when compiled with it on;
- ``"nocomm"``: the same with every collective replaced by a local stand-in of the same shape (``repeat``, a row
  slice): the bound on what hiding communication can win.

``torchrun --nproc-per-node W -m benchmarks.block`` (from the root of a source checkout) times a training step
(forward and backward), prefill (forward, no grad) and a decode step (a few tokens, in a CUDA graph) for each, eager
and compiled (``torch.compile(fullgraph=True)``; torch's async TP is the plain block compiled with Inductor's
micro-pipeline TP pass), and writes ``benchmarks/results/<gpus>-<setting>-block.json``: one row per mode and token
count with the figures named in ``FIGURES``. ``e_block`` compares eager with eager and compiled with compiled.
``check_against_unsharded`` is the correctness check the CPU suite runs with gloo at toy sizes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashoverlap.nn import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel
from flashoverlap.nn import sync_sequence_parallel_grads as sync_grads


@dataclass(frozen=True)
class BlockConfig:
    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    ffn: int = 28672
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TOY = BlockConfig(hidden=64, heads=4, kv_heads=2, ffn=96)


def _attention(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Causal SDPA over ``qkv [T, (heads + 2 kv_heads) * head_dim]`` (q, k, v in that order) -> ``[T, heads *
    head_dim]``."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim).transpose(0, 1)
    k = k.view(tokens, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    v = v.view(tokens, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True)
    return out.squeeze(0).transpose(0, 1).reshape(tokens, heads * head_dim)


class _Decoder(nn.Module):
    """The block's computation, for whole or sharded projections: ``heads``/``kv_heads`` are this module's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n = F.rms_norm(x, (cfg.hidden,), self.attn_norm, cfg.eps)
        h = x + self.o(_attention(self.qkv(n), self.heads, self.kv_heads, cfg.head_dim))
        gate, up = self.gate_up(F.rms_norm(h, (cfg.hidden,), self.ffn_norm, cfg.eps)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


def _column_shard(weight: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Rank r's share of each stacked part (q, k, v; gate, up) of a column-parallel weight (or its gradient)."""
    parts = weight.split(sizes, dim=0)
    return torch.cat([p[rank * (p.shape[0] // world) : (rank + 1) * (p.shape[0] // world)] for p in parts])


class Block(_Decoder):
    """The unsharded block, ``x [T, hidden] -> [T, hidden]``."""

    def __init__(self, cfg: BlockConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        kw = {"device": device, "dtype": dtype}
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.ffn_norm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False, **kw)
        self.o = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False, **kw)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False, **kw)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False, **kw)


# -- how the sharded projections communicate -------------------------------------------------------------------
class _Shard(nn.Module):
    """A projection's shard ``weight [out_local, in_local]`` with plain-PyTorch communication (``"torch"``) or a
    local stand-in of the same shape (``"nocomm"``)."""

    def __init__(self, weight: torch.Tensor, column: bool, group, comm: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.column, self.comm = column, comm
        self.group_name = group.group_name
        self.world = dist.get_world_size(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        if self.column:
            if self.comm:
                x = funcol.all_gather_tensor_autograd(x, 0, self.group_name)
            else:
                x = x.repeat(self.world, 1)
            return F.linear(x, self.weight)
        y = F.linear(x, self.weight)
        if self.comm:
            return funcol.reduce_scatter_tensor_autograd(y, "sum", 0, self.group_name)
        return y[: y.shape[0] // self.world]


class TPBlock(_Decoder):
    """Rank r's shard of a ``Block`` with sequence parallelism: ``x_r [T/W, hidden] -> [T/W, hidden]``."""

    def __init__(self, block: Block, group=None, impl: str = "ours", path: str = "auto") -> None:
        super().__init__()
        if impl not in ("ours", "torch", "nocomm"):
            raise ValueError(f"TPBlock: impl must be 'ours', 'torch' or 'nocomm', got {impl!r}")
        group = group if group is not None else dist.group.WORLD
        cfg = self.cfg = block.cfg
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        for what, count in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("ffn", cfg.ffn)):
            if count % world:
                raise ValueError(f"TPBlock: {what} = {count} must be divisible by the group's {world} ranks")
        self.heads, self.kv_heads = cfg.heads // world, cfg.kv_heads // world
        hd = cfg.head_dim

        with torch.no_grad():
            weights = {
                "qkv": _column_shard(block.qkv.weight, [cfg.heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd], rank,
                                     world),
                "gate_up": _column_shard(block.gate_up.weight, [cfg.ffn, cfg.ffn], rank, world),
                "o": block.o.weight[:, rank * self.heads * hd : (rank + 1) * self.heads * hd],
                "down": block.down.weight[:, rank * cfg.ffn // world : (rank + 1) * cfg.ffn // world],
            }
        for name, weight in weights.items():
            column = name in ("qkv", "gate_up")
            if impl == "ours":
                cls = ColumnParallelLinear if column else RowParallelLinear
                out_f, in_f = weight.shape
                layer = cls(in_f if column else in_f * world, out_f * world if column else out_f, bias=False,
                            group=group, sequence_parallel=True, path=path, device=weight.device,
                            dtype=weight.dtype)
                with torch.no_grad():
                    layer.weight.copy_(weight)
            else:
                layer = _Shard(weight.detach().clone(), column, group, comm=impl == "torch")
            setattr(self, name, layer)
        self.attn_norm = nn.Parameter(block.attn_norm.detach().clone())
        self.ffn_norm = nn.Parameter(block.ffn_norm.detach().clone())
        mark_sequence_parallel(self.attn_norm, self.ffn_norm)


# -- the check against the unsharded block --------------------------------------------------------------------
def check_against_unsharded(rank: int, world: int, cfg: BlockConfig = TOY, tokens: int = 32,
                            dtype: torch.dtype = torch.bfloat16, impl: str = "ours") -> dict[str, float]:
    """Loss and every gradient of rank r's ``TPBlock`` against the unsharded block's (same weights and input),
    on the current device; returns the relative errors by name (the caller asserts)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    torch.manual_seed(0)  # every rank builds the same full block and input
    block = Block(cfg, device=device, dtype=dtype)
    x = torch.randn(tokens, cfg.hidden, device=device, dtype=dtype)
    x.requires_grad_(True)
    loss = block(x).float().pow(2).mean()
    loss.backward()
    shard = TPBlock(block, impl=impl)
    per = tokens // world
    x_r = x.detach()[rank * per : (rank + 1) * per].clone().requires_grad_(True)
    y_r = shard(x_r)
    # The same loss: a mean over every token, each rank's part summed over the group.
    part = y_r.float().pow(2).sum() / (tokens * cfg.hidden)
    total = part.detach().clone()
    dist.all_reduce(total)
    part.backward()
    sync_grads(shard)
    errors = {"loss": _rel(total, loss.detach()), "x": _rel(x_r.grad, x.grad[rank * per : (rank + 1) * per])}
    hd, w = cfg.head_dim, world
    want = {"qkv": _column_shard(block.qkv.weight.grad, [cfg.heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd],
                                 rank, w),
            "gate_up": _column_shard(block.gate_up.weight.grad, [cfg.ffn, cfg.ffn], rank, w),
            "o": block.o.weight.grad[:, rank * shard.heads * hd : (rank + 1) * shard.heads * hd],
            "down": block.down.weight.grad[:, rank * cfg.ffn // w : (rank + 1) * cfg.ffn // w]}
    for name, grad in want.items():
        errors[name] = _rel(getattr(shard, name).weight.grad, grad)
    errors["attn_norm"] = _rel(shard.attn_norm.grad, block.attn_norm.grad)
    errors["ffn_norm"] = _rel(shard.ffn_norm.grad, block.ffn_norm.grad)
    return errors


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# -- the benchmark ---------------------------------------------------------------------------------------------
def _time(fn, steps: int, warmup: int, host: list | None = None) -> float:
    """Median ms of ``fn()`` over ``steps`` after ``warmup``, the maximum over ranks (CUDA events; each step
    starts after a barrier, queued behind a GPU sleep so that launch time is hidden as in a running model).
    ``host`` receives the median host time of issuing one step (ms, maximum over ranks)."""
    import time

    from flashoverlap.tune.timing import start_behind_sleep

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times, issued = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(steps):
        dist.barrier()
        torch.cuda.synchronize()
        start_behind_sleep(start)
        t0 = time.perf_counter()
        fn()
        issued.append(1e3 * (time.perf_counter() - t0))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    medians = torch.tensor([statistics.median(times), statistics.median(issued)], dtype=torch.float64,
                           device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    if host is not None:
        host.append(float(medians[1]))
    return float(medians[0])


def _graph_time(fn, steps: int) -> float:
    """``fn`` captured in a CUDA graph (after eager warm-up), its replay timed as ``_time`` does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time(graph.replay, steps, 3)


# Each figure of a results row: which block runs, and whether it is compiled. E_block compares like with like: the
# eager figures with each other, the compiled ones with each other (a compiled block against an eager baseline would
# count the compiler's gain as overlap).
FIGURES = {
    "t_torch_eager_ms": ("torch", False),
    "t_nocomm_eager_ms": ("nocomm", False),
    "t_ours_eager_ms": ("ours", False),
    "t_torch_compiled_ms": ("torch", True),
    "t_nocomm_compiled_ms": ("nocomm", True),
    "t_async_tp_ms": ("async_tp", True),
    "t_ours_compiled_ms": ("ours", True),
}


def e_block(row: dict, compiled: bool, impl: str = "ours") -> float | None:
    """``(t_torch - t_impl) / (t_torch - t_nocomm)``, all three eager or all three compiled (``impl``: ``"ours"``,
    or ``"async_tp"``, which exists compiled only); None where a figure is missing or the bound is not positive."""
    kind = "compiled" if compiled else "eager"
    torch_ms, nocomm_ms = row.get(f"t_torch_{kind}_ms"), row.get(f"t_nocomm_{kind}_ms")
    t = row.get("t_async_tp_ms" if impl == "async_tp" else f"t_ours_{kind}_ms")
    if impl == "async_tp" and not compiled:
        return None
    if None in (torch_ms, nocomm_ms, t) or torch_ms <= nocomm_ms:
        return None
    return (torch_ms - t) / (torch_ms - nocomm_ms)


def bench_rows(cfg: BlockConfig, token_counts: list[int], steps: int, decode_tokens: int, compile_blocks: bool,
               async_tp: bool, log, *, dtype: torch.dtype = torch.bfloat16, backend: str = "inductor",
               time_step=_time, time_graph=_graph_time) -> list[dict]:
    """One row per mode and token count with every figure of ``FIGURES`` (None where skipped or failed, and
    why in ``notes``); ``log(rows)`` after each row. Runs on the current CUDA device, or on the CPU where the group
    is gloo (``time_step``/``time_graph`` then stand-ins: the CPU suite checks the rows' form this way)."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else \
        torch.device("cpu")
    torch.manual_seed(0)
    block = Block(cfg, device=device, dtype=dtype)
    eager = {impl: TPBlock(block, impl=impl) for impl in ("torch", "nocomm", "ours")}
    models: dict[str, nn.Module | None] = dict.fromkeys(FIGURES)
    for name, (impl, compiled) in FIGURES.items():
        if not compiled:
            models[name] = eager[impl]
        elif impl == "async_tp":
            if compile_blocks and async_tp:
                from torch.distributed._symmetric_memory import enable_symm_mem_for_group

                enable_symm_mem_for_group(dist.group.WORLD.group_name)
                # Its own copy of the plain block: Inductor's micro-pipeline TP pass on for this compile only.
                models[name] = torch.compile(TPBlock(block, impl="torch"), fullgraph=True, backend=backend,
                                             **({"options": {"_micro_pipeline_tp": True}}
                                                if backend == "inductor" else {}))
        elif compile_blocks:
            models[name] = torch.compile(eager[impl], fullgraph=True, backend=backend)
    del block
    # Every block shares one code object (_Decoder.forward): each instance, grad mode and token count is a
    # recompilation of it, more than dynamo's default limit of 8, past which it would run the rest eagerly and
    # silently. A limit that fits, and an error rather than a silent eager figure.
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        return _timed_rows(cfg, models, token_counts, steps, decode_tokens, log, world, device, dtype, time_step,
                           time_graph)


def _timed_rows(cfg, models, token_counts, steps, decode_tokens, log, world, device, dtype, time_step,
                time_graph) -> list[dict]:
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens // world, cfg.hidden, device=device, dtype=dtype)
        for mode in ("prefill", "train"):
            rows.append(time_row(models, mode, tokens, x, steps, time_step))
            log(rows)
    x = torch.randn(decode_tokens // world, cfg.hidden, device=device, dtype=dtype)
    row = dict.fromkeys(FIGURES)
    row.update({"mode": "decode", "tokens": decode_tokens})
    for name, (_, compiled) in FIGURES.items():
        if compiled:
            continue
        model = models[name]

        def step(model=model):
            with torch.no_grad():
                model(x)
        row[name] = time_graph(step, steps)
    row["notes"] = {"decode": "each eager block's forward captured in one CUDA graph and replayed"}
    rows.append(row)
    log(rows)
    return rows


def time_row(models: dict, mode: str, tokens: int, x: torch.Tensor, steps: int, time_step=_time,
             contexts: dict | None = None) -> dict:
    """One row: each of ``models`` (figure name -> block, or None: skipped) timed on rank r's input ``x`` in
    ``mode`` (``"prefill"``: forward without grad; ``"train"``: forward and backward of a mean-square loss), with
    ``time_step``; a figure whose block fails is None and why in ``notes``. ``contexts``: figure name -> a
    context-manager factory each of its steps runs inside (a compiler setting that must hold while it compiles)."""
    import contextlib

    row: dict = {"mode": mode, "tokens": tokens, "host_ms": {}}
    for name, model in models.items():
        if model is None:
            row[name] = None
            continue
        within = (contexts or {}).get(name, contextlib.nullcontext)
        if mode == "prefill":
            def step(model=model, x=x, within=within):
                with within(), torch.no_grad():
                    model(x)
        else:
            x_grad = x.clone().requires_grad_(True)

            def step(model=model, x_grad=x_grad, within=within):
                with within():
                    model(x_grad).float().pow(2).mean().backward()
        try:
            host: list[float] = []
            row[name] = time_step(step, steps, 3, host)
            row["host_ms"][name] = host[0]
        except Exception as exc:  # noqa: BLE001  (a baseline that cannot run here: say why, keep going)
            row[name] = None
            row.setdefault("notes", {})[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        for p in model.parameters():
            p.grad = None
    return row


def add_arguments(parser) -> None:
    """The block benchmark's options."""
    from flashoverlap.cli import positive, positive_ints

    parser.add_argument("--tokens", type=positive_ints, default=[8192, 16384], metavar="T,T",
                        help="token counts (batch x sequence), comma-separated (default 8192,16384)")
    parser.add_argument("--steps", type=positive, default=20, help="timed steps per figure, median (default 20)")
    parser.add_argument("--decode-tokens", type=positive, default=16, help="tokens of the decode step (default 16)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the compiled blocks (ours, plain PyTorch TP, no communication)")
    parser.add_argument("--no-async-tp", action="store_true", help="skip torch's async TP (compiled)")
    parser.add_argument("--out", default=None,
                        help="results JSON (default benchmarks/results/<gpus>-<setting>-block.json)")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.run import finish_run, start_run
    from flashoverlap.bench import write_results

    args, _, meta, out, _ = start_run("python -m benchmarks.block", __doc__.split("\n")[0], add_arguments, argv,
                                      "-block")

    def log(rows: list[dict]) -> None:  # the last row, and every row so far in case a later one fails
        if dist.get_rank() == 0:
            row = rows[-1]
            cells = " ".join(f"{k[2:-3]}={v:.2f}" for k, v in row.items() if k in FIGURES and v is not None)
            gains = " ".join(f"E_block_{kind}={e:+.2f}" for kind, e in
                             (("eager", e_block(row, False)), ("compiled", e_block(row, True))) if e is not None)
            print(f"{row['mode']:>8} {row['tokens']:>6} tokens: {cells} {gains} {row.get('notes', '')}", flush=True)
            write_results(out, meta, rows)

    rows = bench_rows(BlockConfig(), args.tokens, args.steps, args.decode_tokens, not args.no_compile,
                      not args.no_async_tp, log)
    return finish_run(out, meta, rows)


if __name__ == "__main__":
    raise SystemExit(main())
