"""Building an expert call's routing layout (``Layout``, ``comm/expert/contract.py``): ``expert_layout`` exchanges
every rank's per-expert counts in one all-gather, checks them on every rank at once (bad indices, an exceeded
bound, ranks that disagree on the mode or the bound), and in exact mode reads the split sizes and the received
counts back to the host (the layer's one host synchronisation).
"""

from __future__ import annotations

import torch

from flashoverlap.comm.collectives import all_gather_into_tensor
from flashoverlap.comm.expert.contract import MODES, Layout
from flashoverlap.comm.protocol import CommGroup


def default_bound(tokens: int, top_k: int) -> int:
    """The worst case for one (source, destination) pair: every choice of every token to one rank. Ranks must
    agree on the bound: this default assumes they all have ``tokens`` tokens."""
    return max(1, tokens * top_k)


class BoundExceeded(RuntimeError):
    """A bounded-mode layout whose rows for one destination exceed the bound (or an expert index out of range):
    raised on every rank, before any token row moves."""


def expert_layout(topk_idx: torch.Tensor, num_experts: int, group: CommGroup, *, mode: str = "exact",
                  bound: int | None = None, topk_weights: torch.Tensor | None = None,
                  name: str = "expert_layout") -> Layout:
    """This rank's routing layout (see the module docstring) for ``topk_idx: [T, k]`` over ``num_experts`` experts
    shared evenly by ``group``'s ranks; ``topk_weights: [T, k]`` (optional) are taken in send order. Collective:
    one all-gather of every rank's ``[W, L + 2]`` counts (each destination's per-expert counts, the rank's number
    of out-of-range indices, its bound): every rank then knows every (source, destination) total, so that a bad
    index, an exceeded bound or ranks that disagree on the mode or the bound make every rank raise together,
    instead of one rank raising (or sizing its buffers differently) while its peers wait in the next collective.

    exact: one host synchronisation (the split sizes, the largest pair's rows, and the check). bounded: none on
    CUDA (the check is ``torch._assert_async``); on the CPU the check is a plain ``BoundExceeded``. ``name``: the
    public op its errors name (the runtime passes ``moe_layout``).
    """
    world, rank, device = group.world_size, group.rank, topk_idx.device
    if num_experts < 1:
        raise ValueError(f"{name}: num_experts must be >= 1, got {num_experts}")
    if num_experts % world:
        raise ValueError(f"{name}: {num_experts} experts cannot be shared evenly by {world} ranks")
    if mode not in MODES:
        raise ValueError(f"{name}: mode must be one of {MODES}, got {mode!r}")
    if mode == "bounded" and (not isinstance(bound, int) or bound < 1):
        raise ValueError(f"{name}: mode='bounded' needs bound >= 1, got {bound!r}")
    local = num_experts // world
    tokens, top_k = topk_idx.shape
    flat = topk_idx.reshape(-1).to(torch.int64)
    expert = flat.clamp(0, num_experts - 1)  # an out-of-range index is reported below, never used to address
    bad = flat != expert  # the indices outside [0, num_experts): the ones the clamp moved
    sorted_expert, send_order = torch.sort(expert, stable=True)
    # Per-expert counts from the sorted indices: no host synchronisation (CUDA's bincount reads the indices' min
    # and max back to the host, twice per layout).
    experts = torch.arange(num_experts, dtype=torch.int64, device=device)
    ends = torch.searchsorted(sorted_expert, experts, right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    message = torch.empty((world, local + 2), dtype=torch.int64, device=device)
    message[:, :local] = counts.view(world, local)
    message[:, local] = bad.sum()
    message[:, local + 1] = bound if mode == "bounded" else 0  # the ranks must agree on it: checked below
    everyone = torch.empty((world * world, local + 2), dtype=torch.int64, device=device)
    all_gather_into_tensor(everyone, message, group.process_group)
    everyone = everyone.view(world, world, local + 2)  # [source, destination, counts, bad indices, bound]
    send_counts, recv_counts = counts.view(world, local), everyone[:, rank, :local].contiguous()
    pair_totals = everyone[:, :, :local].sum(2)  # [source, destination]
    bad_at, bounds = everyone[:, 0, local], everyone[:, 0, local + 1]
    if mode == "exact":
        # The one sync; the largest pair of the group comes with it (every rank reads the same all-gathered totals),
        # and this rank's received counts (each chunk's segments on the host, for the paths that need them).
        summary = torch.cat([pair_totals[rank], pair_totals[:, rank], bad_at, bounds,
                             pair_totals.max().reshape(1), recv_counts.reshape(-1)]).tolist()
        send_splits, recv_splits = summary[:world], summary[world : 2 * world]
        _raise_on_disagreement(summary[3 * world : 4 * world], 0, group, name)
        _raise_on_bad_indices(summary[2 * world : 3 * world], num_experts, group, name)
        send_rows = torch.arange(tokens * top_k, dtype=torch.int64, device=device)
        seg_ends = torch.cumsum(recv_counts.reshape(-1), 0)
        received = summary[4 * world + 1 :]
        splits = {"send_splits": tuple(send_splits), "recv_splits": tuple(recv_splits),
                  "max_pair_rows": summary[4 * world],
                  "recv_counts_host": tuple(tuple(received[s * local : (s + 1) * local]) for s in range(world))}
    else:
        _check_bound(pair_totals, bad_at, bounds, bound, num_experts, group, name)
        send_totals = send_counts.sum(1)
        dest = sorted_expert // local
        dest_starts = torch.cumsum(send_totals, 0) - send_totals
        position = torch.arange(tokens * top_k, dtype=torch.int64, device=device) - dest_starts[dest]
        # Clamped: a row past the bound (an error raised above) never writes outside its slot.
        send_rows = dest * bound + position.clamp(max=bound - 1)
        base = torch.arange(world, dtype=torch.int64, device=device)[:, None] * bound
        seg_ends = (base + torch.cumsum(recv_counts, 1)).reshape(-1)
        splits = {"max_pair_rows": bound}
    seg_starts = seg_ends - recv_counts.reshape(-1)
    layout = Layout(send_order, send_rows, send_counts, recv_counts, seg_starts.to(torch.int32),
                    seg_ends.to(torch.int32), mode=mode, bound=bound if mode == "bounded" else None, top_k=top_k,
                    tokens=tokens, experts=num_experts, **splits)
    return layout.with_weights(topk_weights) if topk_weights is not None else layout


def _raise_on_bad_indices(bad_at: list[int], num_experts: int, group: CommGroup, name: str) -> None:
    ranks = [s for s, n in enumerate(bad_at) if n]
    if ranks:
        raise ValueError(f"{name}: topk_idx: rank(s) {ranks} of {group.name} hold expert indices outside "
                         f"[0, {num_experts}) ({sum(bad_at)} in all); nothing was sent")


def _raise_on_disagreement(bounds: list[int], mine: int, group: CommGroup, name: str) -> None:
    """Every rank got every rank's mode and bound (0: exact): all raise, or none."""
    if any(b != mine for b in bounds):
        said = ", ".join(f"rank {s}: " + (f"bounded, bound={b}" if b else "exact") for s, b in enumerate(bounds))
        raise ValueError(f"{name}: the ranks of {group.name} disagree on the mode or the bound ({said}); "
                         "every rank must pass the same mode and bound (the default bound, tokens * top_k, differs "
                         "where the ranks' token counts differ: pass bound explicitly); nothing was sent")


def _check_bound(pair_totals: torch.Tensor, bad_at: torch.Tensor, bounds: torch.Tensor, bound: int,
                 num_experts: int, group: CommGroup, name: str) -> None:
    """Every rank sees every (source, destination) total, and every rank's bound: all raise, or none."""
    if pair_totals.device.type != "cuda":
        _raise_on_disagreement(bounds.tolist(), bound, group, name)
        _raise_on_bad_indices(bad_at.tolist(), num_experts, group, name)
        totals = pair_totals.tolist()
        over = [(s, d, n) for s, row in enumerate(totals) for d, n in enumerate(row) if n > bound]
        if over:
            worst = max(n for _, _, n in over)
            pairs = ", ".join(f"rank {s} -> rank {d}: {n}" for s, d, n in over[:8])
            raise BoundExceeded(
                f"{name}: bound={bound} rows per (source, destination) exceeded on {group.name} ({pairs}); pass "
                f"bound >= {worst} (the worst case is tokens * top_k), or mode='exact'; nothing was sent")
        return
    ok = (pair_totals.max() <= bound) & (bad_at.sum() == 0) & (bounds == bound).all()
    # torch._assert_async takes messages under 255 characters (a longer one raises at once, on every call): the
    # group's name, which lists its ranks, goes last and is cut where it must be.
    message = (f"flashoverlap: bound={bound} rows per (source, destination) exceeded, an expert index outside [0, "
               f"{num_experts}), or ranks that disagree on the bound: pass one larger bound on every rank (worst case "
               f"tokens * top_k) or mode='exact'; group {group.name}")
    torch._assert_async(ok, message if len(message) < 255 else message[:251] + "...")
