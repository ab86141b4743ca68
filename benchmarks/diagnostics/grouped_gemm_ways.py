"""The three ways of an expert call's grouped GEMM, measured on one GPU as the expert paths run them: the shared part
of ``grouped_gemm_fit.py`` and ``grouped_gemm_validate.py``.

A sample is one rank's slice at W = 2 of an MoE config (``local`` experts, hidden ``H``, expert FFN ``F``, top-k,
tokens per rank: ``rows = tokens * top_k``), one routing and one projection (``up``: ``[rows, H] x [H, 2F]``;
``down``: ``[rows, F] x [F, H]``). Routing: ``balanced`` (every expert the same rows) or ``zipf`` (expert popularity
``i^-1.2`` in a seeded random order, rows drawn from it). The rows arrive in ``CHUNKS`` chunks (one per source
rank), each expert's rows split evenly over them (``tune.grouped.GroupedCall.segments``, the cost model's reading).

The ways, chunk by chunk through ``comm/expert/chunked_gemm.py``'s ``multiply_chunk`` (the library's own code): ``ours``
(the Triton grouped GEMM), ``cublas`` (``torch._grouped_mm``) and ``loop`` (``torch.mm`` per non-empty segment).
Per way: ``gpu_ms``, the median of CUDA-event times of whole calls, interleaved with the other ways in a shuffled
order, each queued behind a GPU sleep longer than its host time (the GPU never waits for the host), after a warm-up;
``host_ms``, the median host time to issue one call while the GPU is busy; ``cost_ms = max(gpu_ms, host_ms)``, what
the cost model predicts. Fresh random bf16 inputs per sample; each way's output is first checked against
``torch._grouped_mm`` per chunk on an output poisoned with NaN.

Off the GPU (``--dry-run``: tiny configs, the Triton kernel interpreted) the same code runs with wall-clock times,
to check the plumbing.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from flashoverlap.comm.expert.chunked_gemm import ChunkGemm, multiply_chunk
from flashoverlap.kernels.grouped_gemm import workspace_size
from flashoverlap.tune.grouped import GroupedCall

CHUNKS = 2
WAYS = {"ours": "triton", "cublas": "cublas", "loop": "loop"}  # our names -> the plan's (ExpertPlan.gemm)
ROUTINGS = ("balanced", "zipf")
PROJS = ("up", "down")


@dataclass(frozen=True)
class Config:
    """One MoE config's per-rank slice at W = 2: ``local`` experts, hidden ``hidden``, expert FFN ``ffn``, top-k,
    ``tokens`` per rank."""

    name: str
    local: int
    hidden: int
    ffn: int
    top_k: int
    tokens: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k


def rows_per_expert(rows: int, experts: int, routing: str, seed: int) -> tuple[int, ...]:
    """Each expert's rows (summing to ``rows``) under ``routing``."""
    if routing == "balanced":
        return GroupedCall.balanced(experts, rows, 1, 1).rows_per_expert
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, experts + 1, dtype=torch.float64) ** -1.2
    popularity = popularity[torch.randperm(experts, generator=gen)]
    chosen = torch.multinomial(popularity, rows, replacement=True, generator=gen)
    return tuple(torch.bincount(chosen, minlength=experts).tolist())


def grouped_call(config: Config, routing: str, proj: str, seed: int = 0) -> GroupedCall:
    """The sample as the cost model reads it."""
    k, n = (config.hidden, 2 * config.ffn) if proj == "up" else (config.ffn, config.hidden)
    return GroupedCall(rows_per_expert(config.rows, config.local, routing, seed), k, n, 2, CHUNKS)


class Sample:
    """One sample's operands on ``device``: the rows chunk by chunk, the weights ``[E, K, N]``, the output."""

    def __init__(self, call: GroupedCall, device: torch.device, dtype: torch.dtype, seed: int = 0):
        self.call = call
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        experts, k, n = len(call.rows_per_expert), call.k, call.n
        self.x = torch.randn(call.rows, k, dtype=dtype, device=device, generator=gen)
        self.w = torch.randn(experts, k, n, dtype=dtype, device=device, generator=gen) / k**0.5
        self.out = torch.empty(call.rows, n, dtype=dtype, device=device)
        self.seg_expert = torch.arange(experts, dtype=torch.int32, device=device)
        self.workspace = torch.empty(workspace_size(experts), dtype=torch.int32, device=device)
        self.chunks = []  # (first row, rows, segment ends on the device, the same on the host)
        first = 0
        for segments in call.segments():
            ends = torch.tensor(segments, dtype=torch.int64).cumsum(0)
            self.chunks.append((first, int(ends[-1]), ends.to(torch.int32).to(device), ends.tolist()))
            first += int(ends[-1])

    def way(self, name: str):
        """One call of way ``name`` over every chunk."""
        gemm = ChunkGemm(WAYS[name], self.w, self.seg_expert, self.workspace, tail=False)

        def run() -> None:
            for first, rows, ends, host_ends in self.chunks:
                multiply_chunk(gemm, self.x[first : first + rows], ends, self.out[first : first + rows], host_ends)
        return run

    def check(self, name: str) -> float:
        """Relative error of way ``name`` against ``torch._grouped_mm`` (fp32 accumulation), per chunk; NaN rows or
        an error above 1e-2 raise."""
        self.out.fill_(float("nan"))
        self.way(name)()
        worst = 0.0
        for first, rows, ends, _ in self.chunks:
            if rows == 0:
                continue
            got = self.out[first : first + rows].float()
            want = torch._grouped_mm(self.x[first : first + rows], self.w, offs=ends).float()
            if torch.isnan(got).any():
                raise AssertionError(f"{name}: NaN in the output (a row was never written)")
            worst = max(worst, float((got - want).norm() / want.norm().clamp_min(1e-30)))
        if worst > 1e-2:
            raise AssertionError(f"{name}: relative error {worst:.2e} against torch._grouped_mm")
        return worst


class Clock:
    """CUDA events and GPU sleeps on a GPU; wall-clock time and no sleep elsewhere (the dry run)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.cycles_per_ms = self._calibrate() if self.cuda else 0.0

    def _calibrate(self) -> float:
        """GPU sleep cycles per millisecond (``torch.cuda._sleep`` counts SM clock cycles)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        torch.cuda._sleep(cycles)  # warm
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / start.elapsed_time(end)

    def sleep(self, ms: float) -> None:
        if self.cuda:
            torch.cuda._sleep(int(self.cycles_per_ms * ms))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def host_ms(self, fn, calls: int = 5) -> float:
        """The median host time (ms) to issue one call of ``fn`` while the GPU sleeps ahead of it."""
        self.sync()
        t0 = time.perf_counter()
        fn()  # sizes the sleep (a warm call: the way ran before): the GPU must stay busy for the whole call
        first = 1e3 * (time.perf_counter() - t0)
        self.sync()
        times = []
        for _ in range(calls):
            self.sleep(min(3 * first + 1.0, 100.0))
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            self.sync()
        return statistics.median(times)

    def gpu_ms(self, fns: dict, host: dict[str, float], iters: int, warmup: int) -> dict[str, float]:
        """Median GPU time (ms) per call of each of ``fns``, interleaved in a shuffled order each round, each call
        queued behind a sleep longer than its host time ``host[name]``."""
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        self.sync()
        times: dict[str, list[float]] = {name: [] for name in fns}
        shuffler = random.Random(0)
        for _ in range(iters):
            order = list(fns)
            shuffler.shuffle(order)
            for name in order:
                if self.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    self.sleep(1.2 * host[name] + 0.5)
                    start.record()
                    fns[name]()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    fns[name]()
                    times[name].append(1e3 * (time.perf_counter() - t0))
        return {name: statistics.median(values) for name, values in times.items()}


def measure(config: Config, routing: str, proj: str, clock: Clock, *, iters: int, warmup: int, seed: int = 0) -> dict:
    """One sample's row: the model's reading of it (``rows_per_expert``, ``K``, ``N``, ``chunks``) and per way its
    GPU time, host time and cost (ms), each way checked first. bf16 on the GPU; fp16 in the dry run (the Triton
    interpreter's bf16 products are wrong)."""
    call = grouped_call(config, routing, proj, seed)
    device = torch.device("cuda" if clock.cuda else "cpu")
    sample = Sample(call, device, torch.bfloat16 if clock.cuda else torch.float16, seed)
    errors = {name: sample.check(name) for name in WAYS}
    fns = {name: sample.way(name) for name in WAYS}
    host = {name: clock.host_ms(fn) for name, fn in fns.items()}
    gpu = clock.gpu_ms(fns, host, iters, warmup)
    del sample
    per_expert = call.rows_per_expert
    row = {"config": config.name, "routing": routing, "proj": proj, "experts": len(per_expert), "rows": call.rows,
           "K": call.k, "N": call.n, "chunks": call.chunks, "max_expert_rows": max(per_expert),
           "mean_expert_rows": call.rows / len(per_expert), "rows_per_expert": list(per_expert)}
    for name in WAYS:
        row[f"t_{name}_gpu_ms"] = gpu[name]
        row[f"t_{name}_host_ms"] = host[name]
        row[f"t_{name}_ms"] = max(gpu[name], host[name])
    row["rel_err"] = errors
    return row


def call_of(row: dict) -> GroupedCall:
    """A results row's sample as the cost model reads it."""
    return GroupedCall(tuple(row["rows_per_expert"]), row["K"], row["N"], 2, row["chunks"])


def run_all(configs: list[Config], dry_run: bool, *, iters: int, warmup: int, each=None) -> list[dict]:
    """Every (config, routing, projection) of ``configs``, one row each, printed as it comes; ``each(rows)`` after
    every row (the scripts write what they have, so that a run cut short keeps its rows)."""
    clock = Clock(torch.device("cpu" if dry_run else "cuda"))
    rows = []
    for config in configs:
        for routing in ROUTINGS:
            for proj in PROJS:
                t0 = time.perf_counter()
                row = measure(config, routing, proj, clock, iters=iters, warmup=warmup)
                rows.append(row)
                times = " ".join(f"{name} {row[f't_{name}_gpu_ms']:.3f}/{row[f't_{name}_host_ms']:.3f}"
                                 for name in WAYS)
                print(f"{config.name:>24} {routing:>8} {proj:>4} rows {row['rows']:>6} K {row['K']:>5} "
                      f"N {row['N']:>5}: gpu/host ms {times} ({time.perf_counter() - t0:.1f} s)", flush=True)
                if each is not None:
                    each(rows)
    return rows
