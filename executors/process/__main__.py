"""`python -m memstep.executors.process ARGS`: an executor process (`main.py` says what it does).

SIGINT is ignored first, before the imports (zmq, torch, the model: seconds on a busy host):
Ctrl-C on `serve` reaches its whole process group, and the core stops its executors itself
(ExecutorStop, then its heartbeats end), so none may die of SIGINT with a traceback, even one
still starting (a standby executor, one started by a recovery).
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)

import os  # noqa: E402
import sys  # noqa: E402

from memstep.executors.process.main import main  # noqa: E402

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # a clean exit would wait on the heartbeat thread's zmq context
