"""``python -m benchmarks.ops --timeline out.png``: one call drawn on two lanes, compute and communication.

The times are read from the GPU: a CUDA event on the communication stream right after each group's stream wait
returns (the moment the GPU saw the group's last tile stored) and one after its collective, both against an event
recorded just before the call. The picture marks sequential matmul-then-collective's time for comparison.
"""

from __future__ import annotations

import textwrap

import torch
import torch.distributed as dist

from flashoverlap.runtime.context import context_of
from flashoverlap.tune.timing import start_behind_sleep


def record(call, device: torch.device, group=None) -> dict:
    """Run ``call()`` once with the NCCL communicator of ``group`` recording, by wrapping its per-group launch
    from outside: the groups' ready/done times in ms."""
    comm = context_of(group or dist.group.WORLD, device).communicator("gemm", "nccl")
    marks: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
    launch_group = comm.launch_group

    def recording(launch, grp, comm_group) -> None:  # runs on the communication stream
        ready = torch.cuda.current_stream(device).record_event(torch.cuda.Event(enable_timing=True))
        launch_group(launch, grp, comm_group)
        marks.append((grp.index, ready, torch.cuda.current_stream(device).record_event(
            torch.cuda.Event(enable_timing=True))))

    comm.launch_group = recording
    try:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier(group=group)
        torch.cuda.synchronize()
        # Queued behind a GPU sleep as in the benchmark's timing, so that the picture shows the GPU's time and
        # not the host's launching of the collectives.
        start_behind_sleep(start)
        call()
        end.record()
        torch.cuda.synchronize()
        groups = [(g, start.elapsed_time(ready), start.elapsed_time(done)) for g, ready, done in marks]
    finally:
        del comm.launch_group  # the class's own again
    return {"total_ms": start.elapsed_time(end), "groups": groups}


def draw(path: str, title: str, timeline: dict, t_seq: float, t_gemm: float, predicted: list[float] | None = None):
    """Two lanes: each group's share of the GEMM (from the previous group's completion to its own) and each
    group's collective (from its readiness to its end); dashed lines at the sequential time and the GEMM alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = timeline["groups"]
    fig, ax = plt.subplots(figsize=(10, 3.3))
    colors = plt.get_cmap("tab10")
    previous = 0.0
    for g, ready, done in groups:
        color = colors(g % 10)
        ax.barh(1, ready - previous, left=previous, height=0.6, color=color, edgecolor="black", linewidth=0.4)
        ax.barh(0, done - ready, left=ready, height=0.6, color=color, edgecolor="black", linewidth=0.4)
        ax.text((previous + ready) / 2, 1, str(g), ha="center", va="center", fontsize=7)
        previous = ready
    if predicted:
        ax.plot(predicted, [1.4] * len(predicted), "v", color="black", markersize=4, label="model: group done")
    ax.axvline(t_seq, color="red", linestyle="--", label=f"sequential {t_seq:.2f} ms")
    ax.axvline(t_gemm, color="gray", linestyle=":", label=f"cuBLAS GEMM alone {t_gemm:.2f} ms")
    ax.axvline(timeline["total_ms"], color="black", label=f"this call {timeline['total_ms']:.2f} ms")
    ax.set_yticks([0, 1], ["communication", "compute\n(group's tiles done)"])
    ax.set_xlabel("ms since the call started")
    ax.set_xlim(0, max(t_seq, timeline["total_ms"]) * 1.05)
    ax.set_title(textwrap.fill(title, 150), fontsize=9)  # long titles (a plan's description) wrap, not clip
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize=7, ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
