"""The P2P communicator's executors on the CPU (see ``tests/comm/p2p_fake_gpu.py``), in a child process."""

import os
import subprocess
import sys


def test_p2p_communicator_code_moves_and_sums_the_right_bytes():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tests.comm.p2p_fake_gpu"], capture_output=True, text=True,
                          env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["reduce_scatter", "ok", "all_reduce", "ok", "all_gather", "ok"]
