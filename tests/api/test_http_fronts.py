"""`--api-server-count N`: N HTTP front processes accept on the one port, each a ZMQ client of
the core; streamed requests over many connections all finish, and stopping the server ends them."""

from __future__ import annotations

import asyncio
import os

import httpx

from memstep.cli.serve import ServerProcess

TINY = ["--model", "random:tiny", "--num-threads", "1"]


async def streams(url: str, n: int) -> list[str]:
    """`n` streamed completions, each on a connection of its own."""

    async def one(i: int) -> str:
        async with httpx.AsyncClient(timeout=120) as http:
            model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
            body = {"model": model, "prompt": f"p{i}", "max_tokens": 6, "ignore_eos": True}
            reply = await http.post(f"{url}/v1/completions", json={**body, "stream": True})
            assert reply.status_code == 200
            return reply.text

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_fronts_share_the_port_and_serve():
    with ServerProcess([*TINY, "--api-server-count", "2"], http=True) as server:
        info = server.wait_ready()
        pids = info["http_pids"]
        assert len(set(pids)) == 2 and all(alive(pid) for pid in pids)
        texts = asyncio.run(streams(server.http_url, 8))
        assert all(
            t.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in t for t in texts
        )
        server.stop()
        for pid in pids:  # the children end with the server (reaped by it, then gone)
            for _ in range(50):
                if not alive(pid):
                    break
                asyncio.run(asyncio.sleep(0.1))
            assert not alive(pid)


def test_zero_fronts_is_a_one_line_error():
    with ServerProcess([*TINY, "--api-server-count", "0"], http=True) as server:
        server.proc.wait(60)
        assert server.proc.returncode == 2, server.log()
        assert "api_server_count must be >= 1" in server.log()
