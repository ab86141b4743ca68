"""The MoE layer benchmark (docs/benchmarks.md, "The MoE layer on two GPUs"): one expert-parallel SwiGLU MoE layer
on ``W`` ranks, flashoverlap's ops against the plain layer users run today, the same tokens, routing and weights.

Per row {config, W, tokens, routing, mode, path, pass}, timed side by side (``timing.time_side_by_side``: CUDA
events, each call queued behind a GPU sleep, median per rank, maximum over ranks, calls interleaved):

- ``t_plain_ms``: the plain layer: the counts' ``all_to_all_single`` and one host synchronisation, the rows in send
  order, NCCL ``all_to_all_single`` with the split sizes, regrouped by expert, ``torch._grouped_mm`` (gate and up
  fused), SwiGLU, ``torch._grouped_mm``, back to (source, expert) order, the reverse ``all_to_all_single``, the
  router-weighted sum (``index_add_``); forward+backward through ``torch.distributed.nn.functional``'s
  differentiable all-to-all;
- ``t_nocomm_ms``: the same with every all-to-all replaced by a local copy of the same size (the rows it would
  have received, recorded once): the bound on what overlap can win;
- ``t_ms``: ``moe_layout`` + ``moe_dispatch_gemm`` + SwiGLU + ``moe_gemm_combine`` on ``path`` (``mode``:
  exact or bounded with the default bound);
- ``E = (t_plain - t) / (t_plain - t_nocomm)``; ``host_us`` and ``host_plain_us``: the host time to issue one call
  while the GPU is busy.

Precisions (``--precisions``, default bf16; every row carries its ``precision``):

- ``bf16``: as above;
- ``fp8-row`` (one scale per row and per expert output column) and ``fp8-block`` (one per 1x128 block of the rows
  and 128x128 block of the weights, DeepSeek-V3's layout): ``t_ms`` the fp8 expert ops (the weights fp8, the rows
  quantised by the ops and dispatched as fp8 with their scales, combine in bf16); ``t_plain_ms`` the plain fp8
  layer: the rows quantised, ``all_to_all_single`` of the fp8 rows and of their scales, ``torch._scaled_grouped_mm``
  (row-wise; block-wise, which torch's grouped GEMM does not take, the received rows dequantised to bf16 into
  ``torch._grouped_mm`` with the dequantised weights), SwiGLU (quantised again), the second GEMM, the
  reverse all-to-all of bf16 rows, the weighted sum; ``t_nocomm_ms`` that layer with local copies;
  ``t_plain_bf16_ms`` the plain bf16 layer beside them. Forward+backward (``fp8-row`` only: block-wise is inference):
  ours is ``ExpertParallelMLP(fp8="row")``'s autograd (torchao's row-wise recipe, bf16 master weights), the plain
  layer the bf16 all-to-alls around torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (torchtitan with
  ``--float8.moe_fqns``; a note row where torchao is missing).

Configs (all experts over the W ranks): Mixtral-8x7B-like (8 experts, top-2, H 4096, F 14336), Qwen3-30B-A3B-like
(128, top-8, H 2048, F 768), DeepSeek-V3-like (256, top-8, H 7168, F 2048); routing balanced (every expert the same
share) or Zipf(1.2) (expert popularity ``i^-1.2`` in a seeded order, k distinct experts per token); bf16.

``torchrun --nproc-per-node W -m benchmarks.moe [--configs ...] [--tokens ...] [--out FILE]`` (from the root of a
source checkout; ``python -m benchmarks.moe --help`` lists the options) writes
``benchmarks/results/<gpu>x<W>-<setting>-moe.json`` ({"meta", "rows"}); ``W = 1`` is a dry run of the code (no
communication to hide). ``bench_rows`` runs on the CPU too (gloo, toy sizes, a stand-in timer) for its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F

from flashoverlap.ops.moe import moe_dispatch_gemm, moe_gemm_combine, moe_layout
from flashoverlap.runtime import experts


@dataclass(frozen=True)
class MoEConfig:
    experts: int
    top_k: int
    hidden: int
    ffn: int


CONFIGS = {
    "mixtral": MoEConfig(8, 2, 4096, 14336),
    "qwen3-30b-a3b": MoEConfig(128, 8, 2048, 768),
    "deepseek-v3": MoEConfig(256, 8, 7168, 2048),
}
TOY_CONFIGS = {"toy": MoEConfig(8, 2, 16, 24)}
ROUTINGS = ("balanced", "zipf")
MODES = ("exact", "bounded")
PASSES = ("forward", "forward+backward")
PATHS = ("auto", "nccl", "p2p", "reference")  # the expert ops' paths (a test checks)
FIGURES = ("t_plain_ms", "t_nocomm_ms", "t_ms")
PRECISIONS = ("bf16", "fp8-row", "fp8-block")
FP8_FIGURES = (*FIGURES, "t_plain_bf16_ms")


def route(tokens: int, config: MoEConfig, routing: str, seed: int, device: torch.device,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx [T, k] int64, topk_weights [T, k])``: balanced (choice c of token t: expert ``(t*k + c + seed)
    % E``) or Zipf(1.2) (k distinct experts per token, popularity ``i^-1.2`` over a seeded order of the experts);
    router weights a softmax of random logits."""
    gen = torch.Generator().manual_seed(seed)
    experts, k = config.experts, config.top_k
    if routing == "balanced":
        idx = (torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :] + seed) % experts
    elif routing == "zipf":
        popularity = torch.arange(1, experts + 1, dtype=torch.float64) ** -1.2
        popularity = popularity[torch.randperm(experts, generator=gen)]
        idx = torch.multinomial(popularity.expand(tokens, -1), k, replacement=False, generator=gen)
    else:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    return idx.to(device), weights.to(device=device, dtype=dtype)


class _StandIn(torch.autograd.Function):
    """A local copy in place of an all-to-all: forward ``out_rows`` (the rows it would have received), backward a
    copy of ``in_rows`` (as many rows as the all-to-all's input): the same bytes, no communication."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, out_rows: torch.Tensor, in_rows: torch.Tensor) -> torch.Tensor:
        ctx.in_rows = in_rows
        return out_rows.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.in_rows.clone(), None, None


def _routing(layer, topk_idx: torch.Tensor, local: int, comm: bool, record: bool) -> tuple:
    """A plain layer's routing (``PlainMoE``, ``PlainFp8MoE``): the (token, choice) rows sorted by expert
    (``order``, their tokens ``token``), the counts exchanged (all-to-all; ``comm=False``: the recorded ones), the
    split sizes each way, and the received rows' permutation from (source, expert) order to expert order for the
    grouped GEMMs (``perm``, and back by ``argsort``) with the experts' cumulative rows ``offs``."""
    world = layer.world
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=world * local)
    if comm:
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=layer.group)
        if record:
            layer.recorded["counts"] = recv_counts.clone()
    else:
        recv_counts = layer.recorded["counts"].clone()
    totals = torch.cat([counts.view(world, local).sum(1), recv_counts.view(world, local).sum(1)]).tolist()
    send_splits, recv_splits = totals[:world], totals[world:]
    token = torch.div(order, k, rounding_mode="floor")
    per_segment = recv_counts.view(world, local).reshape(-1)
    row_expert = torch.repeat_interleave(torch.arange(local, device=topk_idx.device).repeat(world), per_segment,
                                         output_size=sum(recv_splits))
    perm = torch.argsort(row_expert, stable=True)
    offs = torch.cumsum(recv_counts.view(world, local).sum(0), 0).to(torch.int32)
    return order, token, send_splits, recv_splits, perm, offs


class PlainMoE:
    """The plain expert-parallel layer (see the module docstring), on this rank's experts ``w_up [L, H, 2F]``,
    ``w_down [L, F, H]``. ``comm=False``: every all-to-all replaced by a copy of what it delivered last time
    (``record`` first)."""

    def __init__(self, w_up: torch.Tensor, w_down: torch.Tensor, group: dist.ProcessGroup | None,
                 gmm: Callable | None = None) -> None:
        self.w_up, self.w_down, self.group = w_up, w_down, group
        self.gmm = gmm or (lambda a, b, offs: torch._grouped_mm(a, b, offs=offs))  # fp8 training: torchao's
        self.world = dist.get_world_size(group)
        self.recorded: dict[str, torch.Tensor] = {}

    def without_comm(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self(x, topk_idx, topk_weights, comm=False)

    def _exchange(self, name: str, inp: torch.Tensor, rows: int, out_splits: list[int], in_splits: list[int],
                  comm: bool, record: bool) -> torch.Tensor:
        if comm:
            out = inp.new_empty((rows, inp.shape[1]))
            out = dist_fn.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
            if record:
                self.recorded[name] = out.detach().clone()
            return out
        return _StandIn.apply(inp, self.recorded[name], inp.detach())

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, comm: bool = True,
                 record: bool = False) -> torch.Tensor:
        local, ffn = self.w_up.shape[0], self.w_down.shape[1]
        tokens, k = topk_idx.shape
        order, token, send_splits, recv_splits, perm, offs = _routing(self, topk_idx, local, comm, record)
        received = sum(recv_splits)
        x_recv = self._exchange("x", x.index_select(0, token), received, recv_splits, send_splits, comm, record)
        h = self.gmm(x_recv.index_select(0, perm), self.w_up, offs)
        a = F.silu(h[:, :ffn]) * h[:, ffn:]
        y = self.gmm(a, self.w_down, offs).index_select(0, torch.argsort(perm))
        y_back = self._exchange("y", y, tokens * k, send_splits, recv_splits, comm, record)
        weighted = y_back * topk_weights.reshape(-1).index_select(0, order)[:, None].to(y_back.dtype)
        return torch.zeros_like(x).index_add(0, token, weighted)


class PlainFp8MoE:
    """The plain fp8 layer, forward (see the module docstring): the fp8 weights ``w_up [L, H, 2F]``, ``w_down [L, F,
    H]`` (column-major views) with their scales (``scaling`` ``"row"``: ``[L, N]``; ``"block"``: ``[L, K/128,
    N/128]``). ``comm=False``: every all-to-all replaced by a copy of what it delivered last time (``record``
    first)."""

    def __init__(self, w_up: tuple[torch.Tensor, torch.Tensor], w_down: tuple[torch.Tensor, torch.Tensor],
                 scaling: str, group: dist.ProcessGroup | None) -> None:
        from flashoverlap.comm.expert.scaled import dequantised_weight

        self.scaling, self.group = scaling, group
        self.world = dist.get_world_size(group)
        self.w_up, self.w_down = w_up, w_down
        if scaling == "block":  # torch's grouped GEMM takes no block scales: the weights dequantised once
            self.dense = [torch.stack([dequantised_weight(q[i], s[i], "block") for i in range(q.shape[0])]).to(
                torch.bfloat16) for q, s in (w_up, w_down)]
        self.recorded: dict[str, torch.Tensor] = {}

    def without_comm(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self(x, topk_idx, topk_weights, comm=False)

    def _exchange(self, name: str, inp: torch.Tensor, rows: int, out_splits: list[int], in_splits: list[int],
                  comm: bool, record: bool) -> torch.Tensor:
        if not comm:
            return self.recorded[name].clone()
        out = inp.new_empty((rows, *inp.shape[1:]))
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        if record:
            self.recorded[name] = out.clone()
        return out

    def _gemm(self, rows: torch.Tensor, scale: torch.Tensor | None, which: int, offs: torch.Tensor) -> torch.Tensor:
        from flashoverlap.comm.expert.scaled import dequantised_rows, quantise

        if self.scaling == "block":  # the rows as fp8 with 1x128 scales (quantised here where bf16), dequantised
            q, s = (rows, scale) if scale is not None else quantise(rows, "block")
            return torch._grouped_mm(dequantised_rows(q, s).to(torch.bfloat16), self.dense[which], offs=offs)
        q, s = (rows, scale) if scale is not None else quantise(rows, "row")
        w, sw = (self.w_up, self.w_down)[which]
        if rows.device.type == "cuda":
            return torch._scaled_grouped_mm(q, w, s.reshape(-1), sw, offs=offs, out_dtype=torch.bfloat16)
        # The CPU (the benchmark's tests): the same product dequantised.
        from flashoverlap.comm.expert.scaled import dequantised_weight

        dense_w = torch.stack([dequantised_weight(w[i], sw[i], "row") for i in range(w.shape[0])])
        return torch._grouped_mm(dequantised_rows(q, s), dense_w, offs=offs).to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, comm: bool = True,
                 record: bool = False) -> torch.Tensor:
        from flashoverlap.comm.expert.scaled import quantise

        local = self.w_up[0].shape[0]
        ffn = self.w_down[0].shape[1]
        tokens, k = topk_idx.shape
        order, token, send_splits, recv_splits, perm, offs = _routing(self, topk_idx, local, comm, record)
        received = sum(recv_splits)
        xq, sx = quantise(x, self.scaling)
        sent = xq.index_select(0, token)
        q_recv = self._exchange("x", sent.view(torch.uint8), received, recv_splits, send_splits, comm, record)
        s_recv = self._exchange("sx", sx.index_select(0, token), received, recv_splits, send_splits, comm, record)
        h = self._gemm(q_recv.view(xq.dtype).index_select(0, perm), s_recv.index_select(0, perm), 0, offs)
        a = F.silu(h[:, :ffn].float()) * h[:, ffn:].float()
        y = self._gemm(a.to(torch.bfloat16), None, 1, offs).index_select(0, torch.argsort(perm))
        y_back = self._exchange("y", y, tokens * k, send_splits, recv_splits, comm, record)
        weighted = y_back.float() * topk_weights.reshape(-1).index_select(0, order)[:, None].float()
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add(0, token, weighted).to(x.dtype)


def fp8_weights(w: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [L, K, N]`` bf16 as the fp8 ops and ``_scaled_grouped_mm`` take it: a column-major fp8 ``[L, K, N]``
    view and its scales (``nn/fp8_moe.quantise_weight`` of the ``nn.Linear``-shaped ``[L, N, K]``)."""
    from flashoverlap.nn.fp8_moe import quantise_weight

    q, s = quantise_weight(w.transpose(1, 2), scaling)
    return q.transpose(1, 2), s


def _ours_fp8(w_up: tuple, w_down: tuple, group, mode: str, path: str) -> Callable:
    """The fp8 expert ops, forward (inference): bf16 rows quantised by the ops, fp8 weights with their scales."""
    ffn = w_down[0].shape[1]
    experts_total = w_up[0].shape[0] * dist.get_world_size(group)

    def layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        routing = moe_layout(topk_idx, experts_total, group, mode=mode)
        h = moe_dispatch_gemm(x, w_up[0], routing, group, path=path, scale_w=w_up[1])
        a = F.silu(h[:, :ffn]) * h[:, ffn:]
        return moe_gemm_combine(a, w_down[0], topk_weights, routing, group, path=path, scale_w=w_down[1])

    return layer


def _ours_fp8_training(w_up: torch.Tensor, w_down: torch.Tensor, group, mode: str, path: str) -> Callable:
    """``ExpertParallelMLP(fp8="row")``'s experts with autograd (torchao's row-wise recipe) on bf16 master weights
    ``w_up [L, H, 2F]``, ``w_down [L, F, H]`` (their ``nn.Linear``-shaped transposes are the layer's)."""
    from flashoverlap.nn.fp8_moe import _Fp8Combine, _Fp8Dispatch

    ffn = w_down.shape[1]
    experts_total = w_up.shape[0] * dist.get_world_size(group)

    def layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        routing = moe_layout(topk_idx, experts_total, group, mode=mode)
        h = _Fp8Dispatch.apply(x, w_up.transpose(1, 2), routing, group, path)
        a = F.silu(h[:, :ffn]) * h[:, ffn:]
        return _Fp8Combine.apply(a, w_down.transpose(1, 2), topk_weights, routing, group, path)

    return layer


def _torchao_gmm() -> Callable:
    """torchao's differentiable row-wise fp8 grouped GEMM (what its MoE training conversion runs)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return lambda a, b, offs: _to_fp8_rowwise_then_scaled_grouped_mm(a, b, offs, pad_token_groups_for_grouped_mm=False)


def _ours(w_up: torch.Tensor, w_down: torch.Tensor, group, mode: str, path: str) -> Callable:
    ffn = w_down.shape[1]
    experts_total = w_up.shape[0] * dist.get_world_size(group)

    def layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        routing = moe_layout(topk_idx, experts_total, group, mode=mode)
        h = moe_dispatch_gemm(x, w_up, routing, group, path=path)
        return moe_gemm_combine(F.silu(h[:, :ffn]) * h[:, ffn:], w_down, topk_weights, routing, group, path=path)

    return layer


def _step(layer: Callable, args: tuple, grad: torch.Tensor | None, params: list[torch.Tensor]) -> Callable:
    """One timed call: forward, or forward and backward (gradients cleared first, host-side only)."""
    if grad is None:
        def forward():
            with torch.no_grad():
                layer(*args)
        return forward

    def forward_backward():
        for p in params:
            p.grad = None
        layer(*args).backward(grad)
    return forward_backward


def e_overlap(row: dict) -> float | None:
    """``(t_plain - t) / (t_plain - t_nocomm)``, None where there is no communication time to hide."""
    hideable = row["t_plain_ms"] - row["t_nocomm_ms"]
    return None if hideable <= 1e-9 else (row["t_plain_ms"] - row["t_ms"]) / hideable


class _Fp8Layers:
    """The fp8 rows' layers for one config (module docstring): fp8 weights (``"row"``/``"block"``) made once from the
    bf16 ``w_up``, ``w_down``; for training, column-major bf16 master copies (torchao's grouped GEMM asks for them)."""

    def __init__(self, w_up: torch.Tensor, w_down: torch.Tensor, group, precisions, config: MoEConfig) -> None:
        self.group, self.config = group, config
        self.weights = {}
        self.plain = {}
        for precision in precisions:
            scaling = precision.removeprefix("fp8-")
            if precision == "bf16" or (scaling == "block" and (config.hidden % 128 or config.ffn % 128)):
                continue
            self.weights[scaling] = (fp8_weights(w_up, scaling), fp8_weights(w_down, scaling))
            self.plain[scaling] = PlainFp8MoE(*self.weights[scaling], scaling, group)
        self.master = self.plain_train = None
        if "fp8-row" in precisions:  # column-major copies: leaves of their own
            self.master = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_up, w_down)]
            try:
                self.plain_train = PlainMoE(*self.master, group, gmm=_torchao_gmm())
            except ImportError:
                self.plain_train = None

    def record(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> None:
        for layer in self.plain.values():
            layer(x, idx, weights, record=True)
        if self.plain_train is not None:
            with torch.no_grad():
                self.plain_train(x, idx, weights, record=True)

    def skip(self, precision: str, train: bool) -> str | None:
        scaling = precision.removeprefix("fp8-")
        if scaling not in self.weights:
            return f"{precision} needs H and F multiples of 128 (H {self.config.hidden}, F {self.config.ffn})"
        if train and scaling == "block":
            return "fp8-block is inference only (forward)"
        if train and self.plain_train is None:
            return "the plain fp8 training layer needs torchao (pip install torchao)"
        return None

    def fns(self, precision: str, mode: str, path: str, args: tuple, grad: torch.Tensor | None, plain_bf16,
            params: list[torch.Tensor]) -> dict:
        scaling = precision.removeprefix("fp8-")
        bf16 = _step(plain_bf16, args, grad, params)
        if grad is None:
            layer = self.plain[scaling]
            w_up, w_down = self.weights[scaling]
            return {"t_plain_ms": _step(layer, args, None, params),
                    "t_nocomm_ms": _step(layer.without_comm, args, None, params),
                    "t_ms": _step(_ours_fp8(w_up, w_down, self.group, mode, path), args, None, params),
                    "t_plain_bf16_ms": bf16}
        leaves = [args[0], *self.master, args[2]]
        for t in self.master:
            t.requires_grad_(True)
        train = self.plain_train
        return {"t_plain_ms": _step(train, args, grad, leaves),
                "t_nocomm_ms": _step(train.without_comm, args, grad, leaves),
                "t_ms": _step(_ours_fp8_training(*self.master, self.group, mode, path), args, grad, leaves),
                "t_plain_bf16_ms": bf16}


def bench_rows(configs: dict[str, MoEConfig], token_counts: list[int], routings: list[str], modes: list[str],
               paths: list[str], passes: list[str], timer: Callable, log: Callable[[list[dict]], None] | None = None,
               device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16,
               group: dist.ProcessGroup | None = None, seed: int = 0,
               precisions: list[str] | tuple[str, ...] = ("bf16",)) -> list[dict]:
    """Every row (see the module docstring). ``timer(fns, host_us) -> {name: ms}``: ``timing.time_side_by_side``
    on the GPU, a stand-in on the CPU. A path that cannot serve the call is skipped with a note row, and so is an
    fp8 row that cannot run (block-wise training, a width not a multiple of 128 block-wise, torchao missing)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rows: list[dict] = []

    def add(row: dict) -> None:  # every row, measured or a note, said and written as it comes
        rows.append(row)
        if log is not None:
            log(rows)

    for name, config in configs.items():
        if config.experts % world:
            raise ValueError(f"{name}: {config.experts} experts cannot be shared by {world} ranks")
        local = config.experts // world
        gen = torch.Generator(device=device).manual_seed(seed + 7919 * rank)
        w_up = (torch.randn(local, config.hidden, 2 * config.ffn, generator=gen, device=device, dtype=dtype)
                / config.hidden**0.5)
        w_down = (torch.randn(local, config.ffn, config.hidden, generator=gen, device=device, dtype=dtype)
                  / config.ffn**0.5)
        plain = PlainMoE(w_up, w_down, group)
        fp8 = _Fp8Layers(w_up, w_down, group, precisions, config)
        for tokens in token_counts:
            x = torch.randn(tokens, config.hidden, generator=gen, device=device, dtype=dtype)
            grad = torch.randn(tokens, config.hidden, generator=gen, device=device, dtype=dtype)
            for routing in routings:
                idx, weights = route(tokens, config, routing, seed + rank, device, dtype)
                plain(x, idx, weights, record=True)  # what the stand-ins copy
                fp8.record(x, idx, weights)
                for pass_ in passes:
                    train = pass_ == "forward+backward"
                    for tensor in (x, w_up, w_down, weights):
                        tensor.requires_grad_(train)
                    params = [x, w_up, w_down, weights]
                    for path in paths:
                        try:
                            resolved = experts.resolved_path("bench moe", device, dtype, group, path)
                        except ValueError as exc:
                            add({"config": name, "W": world, "tokens": tokens, "routing": routing, "path": path,
                                 "pass": pass_, "notes": f"skipped: {exc}"})
                            continue
                        for mode, precision in ((m, p) for m in modes for p in precisions):
                            base = {"config": name, "W": world, "tokens": tokens, "routing": routing, "mode": mode,
                                    "path": resolved, "pass": pass_}
                            step_grad = grad if train else None
                            if precision == "bf16":
                                figures = FIGURES
                                fns = {
                                    "t_plain_ms": _step(plain, (x, idx, weights), step_grad, params),
                                    "t_nocomm_ms": _step(plain.without_comm, (x, idx, weights), step_grad, params),
                                    "t_ms": _step(_ours(w_up, w_down, group, mode, path), (x, idx, weights),
                                                  step_grad, params),
                                }
                            else:
                                note = fp8.skip(precision, train)
                                if note:
                                    add({**base, "precision": precision, "notes": f"skipped: {note}"})
                                    continue
                                figures = FP8_FIGURES
                                fns = fp8.fns(precision, mode, path, (x, idx, weights), step_grad, plain, params)
                            host: dict[str, float] = {}
                            try:
                                times = timer(fns, host)
                            except (RuntimeError, AssertionError) as exc:  # a GEMM that refuses the shapes (fp8)
                                if precision == "bf16":
                                    raise
                                add({**base, "precision": precision,
                                     "notes": f"failed: {type(exc).__name__}: {str(exc)[:300]}"})
                                continue
                            row = {**base, "experts": config.experts, "top_k": config.top_k,
                                   **{f: round(times[f], 4) for f in figures}}
                            row["E"] = e_overlap(row)
                            row["host_us"] = round(host["t_ms"], 1)
                            row["host_plain_us"] = round(host["t_plain_ms"], 1)
                            row["precision"] = precision
                            add(row)
                    for tensor in (x, w_up, w_down, weights):
                        tensor.requires_grad_(False)
                        tensor.grad = None
    return rows


def add_arguments(parser) -> None:
    """The MoE layer benchmark's options. Lists are space-separated (``--paths auto nccl``), as the two-GPU run's
    script passes them."""
    from flashoverlap.cli import non_negative, positive

    def names(flag: str, choices: list[str], default: list[str], what: str, metavar: str) -> None:
        parser.add_argument(flag, nargs="+", choices=choices, default=default, metavar=metavar,
                            help=f"{what}, space-separated, from {', '.join(choices)} (default: "
                                 f"{' '.join(default)})")

    names("--configs", list(CONFIGS), list(CONFIGS), "model configs", "CONFIG")
    parser.add_argument("--tokens", nargs="+", type=positive, default=[4096, 16384], metavar="T",
                        help="tokens per rank, space-separated (default: 4096 16384)")
    names("--routings", list(ROUTINGS), list(ROUTINGS), "routings", "ROUTING")
    names("--modes", list(MODES), list(MODES), "uneven-split modes", "MODE")
    names("--paths", list(PATHS), ["auto"], "paths", "PATH")
    names("--passes", list(PASSES), list(PASSES), "passes", "PASS")
    names("--precisions", list(PRECISIONS), ["bf16"], "precisions", "PRECISION")
    parser.add_argument("--warmup", type=non_negative, default=3, help="untimed calls first (default 3)")
    parser.add_argument("--iters", type=positive, default=20, help="timed calls per figure (default 20)")
    parser.add_argument("--out", default=None,
                        help="results JSON (default benchmarks/results/<gpu>x<W>-<setting>-moe.json)")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.run import finish_run, start_run
    from flashoverlap.bench import write_results
    from flashoverlap.tune.timing import time_side_by_side

    args, _, meta, out, device = start_run("python -m benchmarks.moe", __doc__.split("\n\n")[0], add_arguments, argv,
                                           "-moe")

    def timer(fns: dict, host: dict) -> dict:
        return time_side_by_side(fns, warmup=args.warmup, iters=args.iters, host_us=host)

    def log(rows: list[dict]) -> None:
        if dist.get_rank() == 0:
            row = rows[-1]
            if "notes" in row:
                print(f"{row['config']:>14} {row.get('precision', '')}: {row['notes']}", flush=True)
                write_results(out, meta, rows)
                return
            figures = " ".join(f"{f}={row[f]:.3f}" for f in FP8_FIGURES if f in row)
            e = "E=  n/a" if row["E"] is None else f"E={row['E']:+.2f}"
            print(f"{row['config']:>14} {row['precision']:>9} W={row['W']} {row['tokens']:>6} {row['routing']:>8} "
                  f"{row['mode']:>7} "
                  f"{row['path']:>9} {row['pass']:>16}: {figures} {e} host_us={row['host_us']:.0f} "
                  f"(plain {row['host_plain_us']:.0f})", flush=True)
            write_results(out, meta, rows)

    configs = {name: CONFIGS[name] for name in args.configs}
    rows = bench_rows(configs, args.tokens, args.routings, args.modes, args.paths, args.passes, timer, log, device,
                      precisions=args.precisions)
    return finish_run(out, meta, rows)


if __name__ == "__main__":
    raise SystemExit(main())
