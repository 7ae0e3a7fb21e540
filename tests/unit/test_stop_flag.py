"""serve's stop flag: a signal handler that interrupts the main thread inside the flag's wait() must not hang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# SIGTERM raised at each of the first 200 lines the main thread runs inside wait() (threading.py, embedded.py):
# with a threading.Event, one lands while wait() holds the Event's lock and the handler's set() waits for it forever.
PROGRAM = """
import signal, sys
from triton_embed_server.__main__ import install_stop_handlers
flag = install_stop_handlers()
raised = 0
def tracer(frame, event, arg):
    global raised
    if event == "line" and raised < 200 and frame.f_code.co_filename.endswith(("threading.py", "embedded.py")):
        raised += 1
        signal.raise_signal(signal.SIGTERM)
    return tracer
sys.settrace(tracer)
woke = flag.wait(0.3)
sys.settrace(None)
print(woke, raised)
"""


def test_a_signal_inside_the_stop_flags_wait_sets_it_without_hanging():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={"PYTHONPATH": str(ROOT / "server"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    woke, raised = done.stdout.split()
    assert woke == "True" and int(raised) >= 1
