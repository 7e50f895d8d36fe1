"""New requests while a new executor starts: queued up to `--max-new-while-recovering` of them
(the running requests, re-admitted, do not count), then refused with a typed `recovering`
error; served again once recovered.

The standby executor is off here, so that the recovery lasts the seconds of a fresh start.
"""

from __future__ import annotations

import asyncio
import time

from memstep.api.client import AsyncClient, Client, ServerError
from memstep.cli.serve import ServerProcess

TINY = ["--model", "random:tiny", "--num-threads", "1", "--standby-executor", "off"]
LIMIT = 2
NUM_RUNNING = 2  # re-admitted by the recovery: kept beside the limit
NUM_NEW = 5


async def _during_recovery(address: str) -> tuple[list, list]:
    """Two long streams; once the executor is lost, five new requests at once."""
    async with AsyncClient(address, timeout=60) as client:
        streams = [
            await client.generate(
                f"long {i}", stream=True, max_tokens=100, ignore_eos=True, temperature=0.0
            )
            for i in range(NUM_RUNNING)
        ]
        await anext(streams[0])  # serving
        deadline = time.monotonic() + 30
        while (health := await client.health()).status != "recovering":
            assert time.monotonic() < deadline, f"never recovering: {health}"
        new = [
            client.generate(f"new {i}", max_tokens=4, ignore_eos=True, temperature=0.0)
            for i in range(NUM_NEW)
        ]
        answers = await asyncio.gather(*new, return_exceptions=True)
        finished = []
        for stream in streams:
            async for _ in stream:
                pass
            finished.append(stream.result)
        return answers, finished


def test_new_requests_queue_during_recovery_until_the_limit_then_get_recovering():
    args = [*TINY, "--debug-kill-executor-at", "3", "--max-new-while-recovering", str(LIMIT)]
    with ServerProcess(args) as server:
        server.wait_ready()
        answers, finished = asyncio.run(asyncio.wait_for(_during_recovery(server.address), 120))
        with Client(server.address, timeout=30) as client:
            after = client.generate("after the recovery", max_tokens=3, temperature=0.0)
            health = client.health()
    served = [a for a in answers if not isinstance(a, BaseException)]
    refused = [a for a in answers if isinstance(a, ServerError)]
    assert len(served) == LIMIT, answers
    assert len(refused) == NUM_NEW - len(served) and all(e.code == "recovering" for e in refused)
    assert "limit 2" in refused[0].message
    assert all(len(done.token_ids) == 4 for done in served)
    assert [len(done.token_ids) for done in finished] == [100] * NUM_RUNNING
    assert health.status == "ok" and len(after.token_ids) == 3
