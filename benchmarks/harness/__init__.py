"""What the benchmarks share (see ``benchmarks/__init__.py``)."""
