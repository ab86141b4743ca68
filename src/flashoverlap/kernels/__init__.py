"""Triton kernels, each with a plain-Python launcher. They know tiles, tile order and counters; not ranks."""
