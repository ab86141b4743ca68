"""What path="auto" picks, from what every rank observed (pure; the observation itself needs GPUs)."""

from flashoverlap.ops import _common


def test_auto_picks_p2p_for_all_gather_where_it_applies():
    assert _common.automatic_path("all_gather", None, 2) == ("p2p", _common.automatic_path("all_gather", None, 8)[1])
    path, why = _common.automatic_path("all_gather", "the group spans 2 hosts (a, b)", 2)
    assert path == "nccl" and "spans 2 hosts" in why
    path, why = _common.automatic_path("all_gather", None, 16)
    assert path == "nccl" and "16 ranks" in why
    path, why = _common.automatic_path("all_gather", None, 2, nccl_p2p_disabled=True)
    assert path == "nccl" and "NCCL_P2P_DISABLE" in why


def test_auto_picks_p2p_for_every_op_on_one_nvlink_node():
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        assert _common.automatic_path(op, None, 2)[0] == "p2p"
        assert _common.automatic_path(op, None, 2, nccl_p2p_disabled=True)[0] == "nccl"


def test_a_tuned_auto_plan_decides_the_path_where_it_applies():
    from flashoverlap.plan import default_plan

    p2p = default_plan("reduce_scatter", 4096, 4096, 4096, 2, path="p2p")
    nccl = default_plan("all_gather", 4096, 4096, 4096, 2)
    assert _common.automatic_path("reduce_scatter", None, 2, tuned=p2p)[0] == "p2p"  # measured, not the rule
    assert _common.automatic_path("all_gather", None, 2, tuned=nccl)[0] == "nccl"
    # A tuned P2P plan cannot apply where P2P does not: the rule decides, naming why.
    path, why = _common.automatic_path("reduce_scatter", "the group spans 2 hosts (a, b)", 2, tuned=p2p)
    assert path == "nccl" and "spans 2 hosts" in why
    path, why = _common.automatic_path("all_gather", None, 2, nccl_p2p_disabled=True, tuned=p2p)
    assert path == "nccl" and "NCCL_P2P_DISABLE" in why
