import os

# What the environment said before any test module was imported (see tests/test_environment.py).
INITIAL_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")
