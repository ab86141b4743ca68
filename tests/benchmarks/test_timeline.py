"""The timeline picture from recorded group times (synthetic here; the GPU run records real ones)."""

from benchmarks.harness.timeline import draw


def test_timeline_png(tmp_path):
    recorded = {"total_ms": 1.9, "groups": [(g, 0.2 * (g + 1), 0.2 * (g + 1) + 0.1) for g in range(6)]}
    path = tmp_path / "timeline.png"
    draw(str(path), "test", recorded, t_seq=2.0, t_gemm=1.4, predicted=[0.2, 0.4])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
