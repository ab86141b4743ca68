"""The P2P path's ring over NCCL send/recv instead of copy engines (``path="ring"``): the same blocks, steps and
sub-bands as ``comm/tp/ring_schedule.py``, every multiplication by cuBLAS on the caller's stream ``C``, every transfer
an NCCL send to rank r + 1 grouped with a receive from rank r - 1 on a high-priority stream ``S``. It needs no
symmetric memory and no peer access, so it runs wherever NCCL does (across nodes, through host memory) and on
gloo (the CPU tests).

Reduce-scatter: at step s rank r computes the partial of block ``q = (r - s - 1) mod W``, sub-band by sub-band;
from step 1 on it adds its product onto the partial received from rank r - 1 (``addmm_``); each partial but the
last step's is sent on to rank r + 1 as soon as it is computed. All-reduce adds a ring all-gather of the reduced
blocks, all-gather passes the shards round the ring (own first, then r - 1, r - 2, ... arrive), each sub-band
multiplied as it lands.

Why it cannot deadlock: every rank posts its exchanges in the same (step, sub-band) order, each one a group of a
send to r + 1 and a receive from r - 1, so exchange (s, j) of rank r meets exchange (s, j) of both neighbours; an
exchange waits only for the product it sends, which ``C`` computes from data that earlier exchanges delivered.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from flashoverlap import guards
from flashoverlap.comm.protocol import Call, CommGroup, GroupFields, NoLane
from flashoverlap.comm.tp import ring_schedule as rs
from flashoverlap.plan import Plan


class RingNcclCommunicator(GroupFields, NoLane):
    """A high-priority stream for one (process group, device)."""

    path = "ring"

    def __init__(self, group: CommGroup) -> None:
        super().__init__(group)
        self.cuda = self.device.type == "cuda"
        self.stream = guards.comm_stream(self.device) if self.cuda else None
        world = self.world_size
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % world)

    # -- stream plumbing that is a no-op on the CPU (gloo runs each exchange to completion as it is posted) ----
    def _on_comm(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _mark(self, stream):
        return stream.record_event() if self.cuda else None

    def _after(self, stream, event) -> None:
        if self.cuda:
            stream.wait_event(event)

    def _exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None) -> None:
        """On ``S``: send to rank r + 1 and receive from rank r - 1, grouped; ``S`` waits for both."""
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group))
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One call of a ring plan (not sequential); the hook issues independent work on ``C`` where it would wait
        for its first receive."""
        plan, a, b, hook, return_gathered = call.plan, call.a, call.b, call.hook, call.return_gathered
        if call.scales is not None:  # the policy refuses fp8 ring plans (reason_not_ring): never an unscaled product
            raise RuntimeError(f"flashoverlap: {call.name}: the ring communicator multiplies no fp8 operands (it "
                               "reads no scales); the path policy should have refused this call")
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            self.stream.wait_stream(compute)  # inputs ready, and memory handed out on C free to use on S
        if plan.op == "all_gather":
            result = self._all_gather(plan, a.contiguous(), b, compute, return_gathered, hook)
        else:
            result = self._reduce(plan, a, b, compute, hook)
        if self.cuda:
            compute.wait_stream(self.stream)
            for tensor in (a, *result):
                if tensor is not None:
                    tensor.record_stream(self.stream)
        return result

    def release(self) -> None:
        pass  # a stream only

    def _reduce(self, plan: Plan, a, b, compute, hook) -> tuple[torch.Tensor, None]:
        world, r = self.world_size, self.rank
        bands = rs.blocks(plan)
        rows = plan.block_rows if plan.op == "reduce_scatter" else plan.m
        out = torch.empty((rows, plan.n), dtype=a.dtype, device=a.device)

        def block_of(s: int) -> int:
            return (r - s - 1) % world

        def target(s: int, j: int) -> torch.Tensor:
            """Where step s's sub-band j is computed: a fresh buffer, or at the last step the output."""
            row, count = bands[block_of(s)][j]
            if s < world - 1:
                return torch.empty((count, plan.n), dtype=a.dtype, device=a.device)
            start = row - bands[r][0][0] if plan.op == "reduce_scatter" else row
            return out[start : start + count]

        dst = {(0, j): target(0, j) for j in range(len(bands[block_of(0)]))}
        arrived: dict[tuple[int, int], object] = {}
        reduced = []
        for s in range(world):
            if s == 1 and hook is not None:
                hook()
            for j, (row, count) in enumerate(bands[block_of(s)]):
                if s > 0:
                    self._after(compute, arrived[(s, j)])
                    dst[(s, j)].addmm_(a[row : row + count], b)
                else:
                    torch.mm(a[row : row + count], b, out=dst[(s, j)])
                done = self._mark(compute)
                if s == world - 1:
                    reduced.append(done)
                    continue
                dst[(s + 1, j)] = target(s + 1, j)
                with self._on_comm():
                    self._after(self.stream, done)
                    self._exchange(dst[(s, j)], dst[(s + 1, j)])
                    arrived[(s + 1, j)] = self._mark(self.stream)
        if plan.op == "all_reduce":  # the reduced blocks round the ring: block r - t goes on, r - t - 1 arrives
            with self._on_comm():
                for event in reduced:
                    self._after(self.stream, event)
                for t in range(world - 1):
                    for j in range(len(bands[r])):
                        send_row, send_count = bands[(r - t) % world][j]
                        recv_row, recv_count = bands[(r - t - 1) % world][j]
                        self._exchange(out[send_row : send_row + send_count], out[recv_row : recv_row + recv_count])
        return out, None

    def _all_gather(self, plan: Plan, a, b, compute, return_gathered, hook) -> tuple[torch.Tensor, torch.Tensor]:
        world, r = self.world_size, self.rank
        bands = rs.blocks(plan)
        per = plan.block_rows
        out = torch.empty((plan.m, plan.n), dtype=a.dtype, device=a.device)
        gathered = torch.empty((plan.m, plan.k), dtype=a.dtype, device=a.device)
        arrived = []
        with self._on_comm():  # the shards round the ring: shard r - t goes on, r - t - 1 arrives
            for t in range(world - 1):
                for j in range(len(bands[r])):
                    send_row, send_count = bands[(r - t) % world][j]
                    recv_row, recv_count = bands[(r - t - 1) % world][j]
                    source = a[send_row - r * per : send_row - r * per + send_count] if t == 0 else \
                        gathered[send_row : send_row + send_count]
                    self._exchange(source, gathered[recv_row : recv_row + recv_count])
                    arrived.append((recv_row, recv_count, self._mark(self.stream)))
        torch.mm(a, b, out=out[r * per : (r + 1) * per])
        if return_gathered:
            gathered[r * per : (r + 1) * per].copy_(a)
        if hook is not None:
            hook()
        for row, count, event in arrived:
            self._after(compute, event)
            torch.mm(gathered[row : row + count], b, out=out[row : row + count])
        return out, gathered if return_gathered else None
