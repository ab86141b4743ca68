"""The P2P path's pure parts: workspace size classes and the decision whether P2P can serve a group."""

import pytest

from flashoverlap.comm.symmetric import MIN_BYTES, group_reason, mapping_of, size_class


def test_size_classes_are_powers_of_two_from_a_floor():
    assert size_class(1) == MIN_BYTES
    assert size_class(MIN_BYTES) == MIN_BYTES
    assert size_class(MIN_BYTES + 1) == 2 * MIN_BYTES
    assert size_class(3 << 30) == 4 << 30
    with pytest.raises(ValueError, match="nbytes"):
        size_class(0)


def _rank(device, host="node0", why=None, no_access=()):
    return {"host": host, "device": device, "why": why, "no_access": list(no_access)}


def test_one_node_with_peer_access_everywhere_can_use_p2p():
    assert group_reason([_rank(0), _rank(1), _rank(2), _rank(3)]) is None
    # A GPU that this rank cannot reach but no rank of the group uses does not matter.
    assert group_reason([_rank(0, no_access=[5]), _rank(1)]) is None


def test_reasons_name_what_is_missing():
    assert "spans 2 hosts" in group_reason([_rank(0), _rank(0, host="node1")])
    why = group_reason([_rank(0), _rank(1), _rank(2, no_access=[0])])
    assert "rank 2's GPU 2 cannot access the memory of rank 0's GPU 0" in why
    assert group_reason([_rank(0), _rank(1, why="no symmetric memory")]) == "rank 1: no symmetric memory"


def test_ranks_sharing_a_gpu_or_a_group_of_another_backend_map_their_peers_by_ipc():
    own_gpus = [("node", f"GPU-{r}", "nccl") for r in range(4)]
    assert mapping_of(own_gpus) == "symmetric"
    assert mapping_of([("node", "GPU-0", "gloo") for _ in range(8)]) == "ipc"  # eight ranks on one GPU
    assert mapping_of([*own_gpus[:3], ("node", "GPU-0", "nccl")]) == "ipc"  # two of them share GPU 0
    assert mapping_of([("node", f"GPU-{r}", "gloo") for r in range(2)]) == "ipc"  # gloo: no symmetric memory
    assert mapping_of([("a", "GPU-0", "nccl"), ("b", "GPU-0", "nccl")]) == "symmetric"  # same index, two hosts
