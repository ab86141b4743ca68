"""One-off measurements behind the design notes, run from the root of a source checkout as modules:
``torchrun --nproc-per-node 2 -m benchmarks.diagnostics.NAME ...`` (each module's docstring gives its command)."""
