"""The benchmark harness, its results and the diagnostics: not installed (``pyproject.toml`` packages ``src/`` only),
run from the root of a source checkout as modules, e.g. ``torchrun --nproc-per-node 2 -m benchmarks.ops``.

- ``ops``, ``block``, ``moe``: the ops' grid against every baseline, the tensor-parallel transformer block, the MoE
  layer (``python -m benchmarks.X --help``); ``moe_gemm``: the expert GEMMs on one GPU; ``model_check``: the
  tuner's model against measurement over the grid.
- ``harness/``: what they share (the start under torchrun and the results file, the baselines, the rows, host-time
  measurement, the timeline picture, the movers); built on the installed ``flashoverlap.bench`` and
  ``flashoverlap.tune.timing``, and free to reach into the library's internals (a benchmark is not the product).
- ``diagnostics/``: one-off measurements behind the design notes (``torchrun ... -m benchmarks.diagnostics.X``).
- ``results/``: the results files the README and docs quote (``readme_tables.py`` renders them).
"""
