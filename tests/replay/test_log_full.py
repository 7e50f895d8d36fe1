"""A full disk under the event log, made with RLIMIT_FSIZE on the server (set from outside with
prlimit, SIGXFSZ ignored so that writes fail with EFBIG): a tmpfs cannot be mounted in a plain
container without privileges, a file-size limit works as any user and can be lifted again.

`--on-log-error stop`: while the log cannot be written /health is 503 with the reason, new
requests get 503 log_unwritable, the request in flight waits; once space returns it finishes and
the log replays exactly.  `--on-log-error continue`: requests are served, and the log carries a
gap record that inspect and replay report.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from memstep.cli.serve import ServerProcess
from memstep.events.log import LogWriter, read_log
from memstep.events.types import RequestAborted

BODY = {"prompt": "hello", "max_tokens": 6, "seed": 1}


@pytest.fixture
def ignore_sigxfsz():
    """Ignored here, ignored in the server started here (an ignored signal survives exec)."""
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGXFSZ, old)


def _limit_file_size(pid: int, num_bytes: int | None) -> None:
    limit = resource.RLIM_INFINITY if num_bytes is None else num_bytes
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def _memstep(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "memstep.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _full_disk_run(policy: str) -> dict:
    args = ["--model", "random:tiny", "--num-threads", "1", "--on-log-error", policy]
    with ServerProcess(args, http=True) as server:
        server.wait_ready()
        url, log_path = server.http_url, server.dir / "events.memlog"
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        _limit_file_size(server.proc.pid, log_path.stat().st_size + 200)
        out: dict = {}
        first = threading.Thread(
            target=lambda: out.update(
                first=httpx.post(
                    url + "/v1/completions", json={**BODY, "max_tokens": 30}, timeout=60
                )
            )
        )
        first.start()
        time.sleep(2.0)  # its steps fill the log
        out["health_full"] = httpx.get(url + "/health", timeout=10)
        out["new_full"] = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
        out["first_done_while_full"] = not first.is_alive()
        _limit_file_size(server.proc.pid, None)
        first.join(60)
        time.sleep(1.0)
        out["health_after"] = httpx.get(url + "/health", timeout=10)
        out["new_after"] = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
        server.stop()
        out["replay"] = _memstep("replay", str(log_path))
        out["inspect"] = _memstep("inspect", str(log_path))
    return out


def test_stop_policy_serves_nothing_unrecorded_and_the_log_replays(ignore_sigxfsz):
    out = _full_disk_run("stop")
    health = out["health_full"]
    assert health.status_code == 503 and health.json()["status"] == "log_unwritable"
    assert "File too large" in health.json()["detail"]
    assert out["new_full"].status_code == 503
    assert out["new_full"].json()["error"]["code"] == "log_unwritable"
    assert not out["first_done_while_full"]  # held, not served unrecorded
    assert (
        out["first"].status_code == 200 and out["first"].json()["usage"]["completion_tokens"] == 30
    )
    assert out["health_after"].status_code == 200 and out["new_after"].status_code == 200
    assert out["replay"].returncode == 0, out["replay"].stdout + out["replay"].stderr
    assert "gap" not in out["inspect"].stdout + out["inspect"].stderr


def test_continue_policy_serves_on_and_the_log_reports_its_gap(ignore_sigxfsz):
    out = _full_disk_run("continue")
    assert out["health_full"].status_code == 200  # serving, the loss said in its detail
    assert "records dropped" in out["health_full"].json()["detail"]
    assert out["new_full"].status_code == 200 and out["first_done_while_full"]
    assert out["health_after"].status_code == 200 and out["new_after"].status_code == 200
    replay = out["replay"]
    assert replay.returncode == 3 and "log gap" in replay.stdout + replay.stderr
    assert "log gap" in out["inspect"].stdout + out["inspect"].stderr


def test_a_failed_flush_leaves_no_torn_record_and_a_retry_writes_it(tmp_path, ignore_sigxfsz):
    """The writer's all-or-nothing flush under a real EFBIG, in this process."""
    path = tmp_path / "x.memlog"
    writer = LogWriter(path, {"config": {}, "model_identity": "m"})
    writer.append(RequestAborted(0, "a"))
    writer.flush()
    size = path.stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 30, hard))
    try:
        for i in range(3):
            writer.append(RequestAborted(i + 1, "b" * 20))
        with pytest.raises(OSError):
            writer.flush()
        assert path.stat().st_size == size  # cut back to the last whole flush
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    writer.flush()
    writer.close()
    _, records, problems = read_log(path)
    assert [r.step for r in records] == [0, 1, 2, 3] and not problems
