"""The fp8 grouped GEMM's tile sweep (``benchmarks/diagnostics/fp8_grouped_tiles.py``) on the CPU, under the Triton
interpreter (a child process, ``python -m tests.benchmarks.test_fp8_grouped_tiles``, sets TRITON_INTERPRET before
triton is imported), tiny shapes, a stand-in timer: every tile's output checked against the loop way, a tile that
computes wrong marked so and never taken as best, and a row's fields."""

import json
import os
import sys

if __name__ == "__main__":  # the child: interpret the kernels (before anything imports triton)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tests.interpreter import interpreted_json, needs_interpreter  # noqa: E402

TILES = ("current", "64x128-s4-w4", "128x256-s3-tiles", "64x128-s4-w4-2sm")


def _rows():
    from benchmarks.diagnostics import fp8_grouped_tiles as sweep
    from flashoverlap.kernels import grouped_gemm

    tiles = {name: sweep.TILES[name] for name in TILES}
    times = {"current": 3.0, "64x128-s4-w4": 1.0, "128x256-s3-tiles": 2.0, "64x128-s4-w4-2sm": 5.0}
    timed = []

    def timer(fn, iters):  # the tile being timed is the last one launched: its stand-in time
        fn()
        timed.append(launched[-1] if launched else "bf16")
        return times.get(timed[-1], 4.0)

    launched = []
    real = grouped_gemm.scaled_grouped_gemm
    computed = {}  # a launch's output by tile, mode and chunk: config_row's inputs are seeded, the same each sweep

    def recording(*args, tile=None, mode=None, out=None, **kwargs):
        launched.append(next(name for name, spec in tiles.items() if sweep.tile_of(spec, mode) == tile))
        key = (launched[-1], mode, out.storage_offset(), out.shape[0])
        if key in computed:  # each tile interpreted once per mode and chunk (the interpreter is slow)
            out.copy_(computed[key])
        else:
            real(*args, tile=tile, mode=mode, out=out, **kwargs)
            computed[key] = out.clone()
        if launched[-1] == wrong:
            out.add_(1.0)  # a tile that computes wrong
        return out

    grouped_gemm.scaled_grouped_gemm = recording
    rows = {}
    for wrong in ("none", "64x128-s4-w4", "current"):
        for scaling in ("block", "row"):
            launched.clear()
            rows[f"{scaling}-{wrong}"] = sweep.config_row("tiny", 2, 256, 160, 96, scaling, 1, device="cpu",
                                                          timer=timer, tiles=tiles)
    return rows


if __name__ == "__main__":
    print(json.dumps(_rows()))
    sys.exit(0)


@pytest.fixture(scope="module")
def rows():
    return interpreted_json("tests.benchmarks.test_fp8_grouped_tiles")


@needs_interpreter
@pytest.mark.parametrize("scaling", ["block", "row"])
def test_every_tile_is_checked_against_the_loop_and_the_fastest_right_one_is_best(rows, scaling):
    row = rows[f"{scaling}-none"]
    assert {"config", "scaling", "experts", "rows", "K", "N", "t_bf16_grouped_mm_ms", "t_scaled_grouped_mm_ms",
            "tiles", "best", "t_best_ms", "bf16_over_best", "bf16_over_current"} <= set(row)
    assert set(row["tiles"]) == set(TILES)
    for name, entry in row["tiles"].items():
        assert entry["ok"] and entry["err"] < 2e-2, (name, entry)
    assert row["best"] == "64x128-s4-w4" and row["t_best_ms"] == 1.0
    assert row["bf16_over_best"] == 4.0 and row["bf16_over_current"] == 4.0 / 3.0
    want = [128, 256, 8, 4, 8, 0, 1] if scaling == "row" else [64, 128, 8, 3, 4, None, 1]  # the kernel's tiles
    assert row["tiles"]["current"]["tile"] == want
    assert row["tiles"]["64x128-s4-w4-2sm"]["tile"] == [64, 128, 8, 4, 4, 0, 2]  # two persistent programs per SM


@needs_interpreter
@pytest.mark.parametrize("scaling", ["block", "row"])
def test_a_tile_that_computes_wrong_is_never_best(rows, scaling):
    row = rows[f"{scaling}-64x128-s4-w4"]
    assert not row["tiles"]["64x128-s4-w4"]["ok"] and row["tiles"]["64x128-s4-w4"]["err"] > 5e-2
    assert row["best"] == "128x256-s3-tiles" and row["t_best_ms"] == 2.0
    # The reference is the loop way's, not the current tile's: a wrong current tile is caught too.
    row = rows[f"{scaling}-current"]
    assert not row["tiles"]["current"]["ok"] and "bf16_over_current" not in row
    assert all(entry["ok"] for name, entry in row["tiles"].items() if name != "current")
    assert row["best"] == "64x128-s4-w4"
