"""What path="auto" picks, from what every rank observed (pure; the observation itself needs GPUs)."""

from flashoverlap.ops import _common


def test_auto_keeps_nccl_until_p2p_is_enabled(monkeypatch):
    monkeypatch.setattr(_common, "AUTO_CHOOSES_P2P", False)
    path, why = _common.automatic_path(None, 2)
    assert path == "nccl" and "not chosen automatically" in why


def test_auto_picks_p2p_where_it_applies(monkeypatch):
    monkeypatch.setattr(_common, "AUTO_CHOOSES_P2P", True)
    assert _common.automatic_path(None, 2)[0] == "p2p"
    assert _common.automatic_path(None, 8)[0] == "p2p"
    path, why = _common.automatic_path("the group spans 2 hosts (a, b)", 16)
    assert path == "nccl" and "spans 2 hosts" in why
    path, why = _common.automatic_path(None, 16)
    assert path == "nccl" and "16 ranks" in why
