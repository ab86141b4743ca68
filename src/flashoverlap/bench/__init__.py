"""Benchmarks: flashoverlap's ops against sequential matmul-then-collective and the decomposition baseline, timed
side by side in one run as ``../shared/docs/benchmarks.md`` prescribes. Baselines live here, not in ``ops``."""
