"""``expert_layout`` on a GPU: the host synchronisations it promises (``comm/expert/layout.py``): none in bounded
mode (a layer in bounded mode can then be issued, and captured, without the host waiting on the GPU), exactly one in
exact mode (the split sizes). Counted by ``torch.cuda.set_sync_debug_mode`` (``testing.host_synchronisations``; it
does not see ``torch.distributed``'s collectives: the layout's one all-gather is asynchronous by NCCL's contract),
on a one-rank NCCL group (one GPU is enough: the count does not depend on the group's size), skewed routing with an
expert that gets no token, the counts checked against ``torch.bincount`` computed afterwards."""

import pytest
import torch
import torch.distributed as dist

from flashoverlap.testing import host_synchronisations, spawn
from tests.gpu.helpers import ENV

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layouts(rank, world_size):
    from flashoverlap.comm.expert import expert_layout
    from flashoverlap.comm.protocol import CommGroup

    group = CommGroup.of(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))
    experts, tokens, top_k = 16, 1777, 4  # 7108 choices: past torch's small-sort path (4096), as layers are
    gen = torch.Generator(device="cuda").manual_seed(5)
    keys = torch.rand(tokens, experts, device="cuda", generator=gen)
    keys = keys + torch.log(1.0 / torch.arange(1, experts + 1, device="cuda") ** 1.2)
    keys[:, 3] = float("-inf")  # expert 3 gets no token
    idx = keys.topk(top_k, dim=1).indices
    want = torch.bincount(idx.reshape(-1), minlength=experts).view(1, experts).cpu()
    expert_layout(idx, experts, group, mode="bounded", bound=tokens * top_k)  # NCCL set up, kernels loaded
    torch.cuda.synchronize()
    found = {}
    for mode, bound in (("bounded", tokens * top_k), ("exact", None)):
        layouts = []

        def build(mode=mode, bound=bound, layouts=layouts):
            layouts.append(expert_layout(idx, experts, group, mode=mode, bound=bound))

        found[mode] = host_synchronisations(build)
        layout = layouts[0]
        assert torch.equal(layout.send_counts.cpu(), want), mode
        assert torch.equal(layout.recv_counts.cpu(), want), mode
    return found


@needs_gpu
def test_bounded_layout_never_waits_for_the_gpu_and_exact_waits_once():
    found = spawn(_layouts, 1, backend="nccl", env=ENV)[0]
    assert len(found["bounded"]) == 0 and len(found["exact"]) == 1, found
