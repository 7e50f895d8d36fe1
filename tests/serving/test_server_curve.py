"""Loopback by default; any other address only with CURVE, and then only for allowed keys."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from memstep.api.client import Client
from memstep.cli.serve import ServerProcess, load_key, load_keys
from memstep.core.config import ConfigError
from memstep.serving.core_config import ServerConfig

SERVER_PUBLIC, SERVER_SECRET = zmq.curve_keypair()
CLIENT_PUBLIC, CLIENT_SECRET = zmq.curve_keypair()
STRANGER_PUBLIC, STRANGER_SECRET = zmq.curve_keypair()


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys")
    (keys / "server.secret").write_bytes(SERVER_SECRET + b"\n")
    (keys / "clients.txt").write_bytes(CLIENT_PUBLIC + b"\n")
    args = ["--model", "random:tiny", "--num-threads", "1", "--zmq-host", "0.0.0.0"]
    args += ["--curve-secret-key", str(keys / "server.secret")]
    args += ["--curve-client-keys", str(keys / "clients.txt")]
    with ServerProcess(args) as server:
        server.wait_ready()
        port = server.address.rsplit(":", 1)[1]
        yield f"tcp://127.0.0.1:{port}"


def test_allowed_curve_client_is_served(address):
    keys = {"curve_public_key": CLIENT_PUBLIC, "curve_secret_key": CLIENT_SECRET}
    with Client(address, timeout=10, curve_server_key=SERVER_PUBLIC, **keys) as client:
        assert client.health().status == "ok"
        assert len(client.generate("secret", max_tokens=3, temperature=0.0).token_ids) == 3


def test_unauthenticated_client_is_refused(address):
    with Client(address, timeout=2) as client, pytest.raises(TimeoutError):
        client.health()


@pytest.mark.parametrize(
    ("server_key", "public", "secret"),
    [
        (SERVER_PUBLIC, STRANGER_PUBLIC, STRANGER_SECRET),  # a key not on the allowed list
        (STRANGER_PUBLIC, CLIENT_PUBLIC, CLIENT_SECRET),  # talking to the wrong server key
    ],
    ids=["unlisted-client-key", "wrong-server-key"],
)
def test_curve_client_without_the_right_keys_is_refused(address, server_key, public, secret):
    keys = {"curve_public_key": public, "curve_secret_key": secret, "curve_server_key": server_key}
    with Client(address, timeout=2, **keys) as client, pytest.raises(TimeoutError):
        client.health()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.7", "::1", "localhost"])
def test_loopback_needs_no_keys(host):
    assert not ServerConfig(host=host).uses_curve


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "*", "example.com", "::"])
def test_other_addresses_need_curve(host):
    with pytest.raises(ConfigError, match="without CURVE"):
        ServerConfig(host=host)
    allowed = frozenset({CLIENT_PUBLIC})
    assert ServerConfig(
        host=host, curve_secret_key=SERVER_SECRET, curve_client_keys=allowed
    ).uses_curve


def test_curve_needs_both_halves():
    with pytest.raises(ConfigError, match="both"):
        ServerConfig(curve_secret_key=SERVER_SECRET)
    with pytest.raises(ConfigError, match="both"):
        ServerConfig(curve_client_keys=frozenset({CLIENT_PUBLIC}))


@pytest.mark.parametrize(
    ("entry", "prefix"),
    [(["memstep.cli.main", "serve"], "memstep"), (["memstep.cli.serve"], "memstep serve")],
)
def test_serve_refuses_a_public_bind_without_keys_before_loading_anything(entry, prefix):
    cmd = [sys.executable, "-m", *entry, "--zmq-host", "0.0.0.0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert f"{prefix}: error: refusing to listen on '0.0.0.0' without CURVE" in res.stderr
    assert "Traceback" not in res.stderr


def test_key_loading(tmp_path):
    assert load_key(SERVER_SECRET.decode()) == SERVER_SECRET
    assert load_keys(f"{CLIENT_PUBLIC.decode()},{STRANGER_PUBLIC.decode()}") == {
        CLIENT_PUBLIC,
        STRANGER_PUBLIC,
    }
    with pytest.raises(ConfigError):
        load_key("not-a-key")
    with pytest.raises(ConfigError):
        load_keys("short,keys")


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "file"])
def test_inline_secret_key_works_but_is_public_and_warned_about(tmp_path, inline):
    secret_file = tmp_path / "server.secret"
    secret_file.write_bytes(SERVER_SECRET)
    secret_file.chmod(0o600)
    args = ["--model", "random:tiny", "--num-threads", "1", "--curve-client-keys"]
    args += [CLIENT_PUBLIC.decode(), "--curve-secret-key"]
    args += [SERVER_SECRET.decode() if inline else str(secret_file)]
    keys = {"curve_public_key": CLIENT_PUBLIC, "curve_secret_key": CLIENT_SECRET}
    with ServerProcess(args) as server:
        server.wait_ready()
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        with Client(server.address, timeout=10, curve_server_key=SERVER_PUBLIC, **keys) as client:
            assert client.health().status == "ok"
        log = server.log()
    assert (SERVER_SECRET in cmdline) == inline  # what any local user can read
    assert ("CURVE secret key given inline" in log) == inline, log
