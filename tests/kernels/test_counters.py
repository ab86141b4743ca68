"""The graph form of a counter wait (``kernels/counters.py``) under the Triton interpreter: it returns only once the
counter has reached the value (another thread writes it late), and resets that counter and no other. In a child
process: TRITON_INTERPRET must be set before triton is imported, and never in this process."""

import json
import os
import subprocess
import sys

from tests.interpreter import needs_interpreter

pytestmark = needs_interpreter

CHILD = r"""
import json, threading, time
import torch
from flashoverlap.kernels.counters import wait_reset

counters = torch.tensor([0, 5, 3, 9], dtype=torch.int32)
wait_reset(counters, 1, 5)  # already there: returns, resets counter 1 only
first = counters.tolist()

stored, done = [], threading.Event()
def producer():  # the group's last tile lands late; stored again until the wait returns, because the interpreter's
    time.sleep(0.2)  # atomics are not atomic against this thread's stores (a lost store would hang the wait)
    stored.append(time.perf_counter())
    while not done.is_set():
        counters[2] = 7
        time.sleep(0.01)

thread = threading.Thread(target=producer)
thread.start()
wait_reset(counters, 2, 7)
returned = time.perf_counter()
done.set()
thread.join()
print(json.dumps({"first": first, "untouched": counters[[0, 1, 3]].tolist(),
                  "waited": bool(stored) and returned >= stored[0]}))
"""


def test_the_wait_kernel_waits_for_the_value_then_resets_its_counter():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["first"] == [0, 0, 3, 9]  # counter 1 reset, the others untouched
    assert row["waited"], "returned before the counter reached the value"
    assert row["untouched"] == [0, 0, 9]
