"""The router tests' helpers (a module of its own name: `conftest` is a name every test folder
has, so importing from it finds whichever was loaded first)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from memstep.api.client import AsyncClient
from memstep.router.router import Router, RouterConfig

MODEL = ["--model", "random:tiny", "--max-num-seqs", "8"]  # a batch of 32 runs in waves


@contextlib.contextmanager
def running(endpoints: list[str], log: Path, **options: object) -> Iterator[Router]:
    """A Router over `endpoints`, turning in a thread until the block ends."""
    router = Router(endpoints, RouterConfig(seed=0, **options), log)  # type: ignore[arg-type]
    assert router.wait_live(30), "the replicas did not answer"
    thread = threading.Thread(target=router.serve_forever, daemon=True)
    thread.start()
    try:
        yield router
    finally:
        router.stop()
        thread.join(10)
        router.close()


def prompt_of(i: int) -> str:
    return f"Request {i}: tell a story about the number {i * 7919 % 1000} and a river."


async def _stream(client: AsyncClient, i: int, max_tokens: int, on_token: Callable) -> tuple:
    stream = await client.generate(
        prompt_of(i),
        stream=True,
        max_tokens=max_tokens,
        seed=1000 + i,
        temperature=0.9,
        ignore_eos=True,
    )
    streamed: list[int] = []
    async for delta in stream:
        streamed += delta.token_ids
        on_token(len(delta.token_ids))
    assert stream.result is not None
    return streamed, list(stream.result.token_ids), stream.result.finish_reason


def run_batch(
    endpoint: str, n: int = 32, max_tokens: int = 48, kill_pid: int = 0, kill_after: int = 0
) -> dict[int, tuple]:
    """`n` seeded streaming requests at once; with `kill_pid`, SIGKILL it once `kill_after`
    tokens have streamed.  Each request's (streamed tokens, GenerateDone's tokens, reason)."""
    seen = [0]

    def on_token(count: int) -> None:
        seen[0] += count
        if kill_pid and seen[0] >= kill_after > 0:
            os.kill(kill_pid, signal.SIGKILL)
            seen[0] = -(10**9)  # once

    async def main() -> list[tuple]:
        async with AsyncClient(endpoint, timeout=60) as client:
            jobs = [_stream(client, i, max_tokens, on_token) for i in range(n)]
            return list(await asyncio.gather(*jobs))

    return dict(enumerate(asyncio.run(main())))


def differences(reference: dict[int, tuple], got: dict[int, tuple]) -> list[int]:
    """The requests whose streamed or final tokens, or finish reason, differ from `reference`."""
    return [i for i in reference if got.get(i) != reference[i]]
