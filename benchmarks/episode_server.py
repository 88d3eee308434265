"""Claim+end cycles per second of the episode server, beside a no-op endpoint on the same stack.

One run starts the episode server (FastAPI on uvicorn, SQLite store in WAL mode, exactly
as ``nexrl train`` runs it) in a child process, with a no-op route ``POST /noop`` added
to the same app. The parent drives it with 32 concurrent keep-alive HTTP/1.1 clients
(a minimal asyncio client, so the client costs as little as possible and the same
client measures both sides):

* episode cycle: ``POST /claim_episode`` then ``POST /end_episode`` with the claim's key
  (each end is committed to SQLite before its answer);
* ceiling: two ``POST /noop`` calls with bodies of the same size.

The two sides take turns (``--rounds``, 5 by default) on the same connections, so a
burst of other work on a shared machine slows both rather than one.
It prints both rates and their ratio against the target (episode >= 55 % of the
ceiling) and exits 0 whatever the verdict.

    .venv/bin/python benchmarks/episode_server.py              # 32 clients, 5 s per side in 5 turns
    .venv/bin/python benchmarks/episode_server.py --clients 8 --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 0.55


def serve(database: str, episodes: int) -> None:
    """Child process: the server with ``episodes`` queued, its URL on stdout, until stdin closes."""
    from nexrl_core.run.llm_client import SamplingDefaults
    from nexrl_core.run.rollout import RunRequest
    from nexrl_episodes.book import EpisodeBook
    from nexrl_episodes.server import EpisodeServer
    from nexrl_episodes.store import EpisodeStore

    store = EpisodeStore(f"sqlite:///{database}")
    book = EpisodeBook(store, claim_timeout_s=600, max_attempts=3)
    server = EpisodeServer(book, None)

    @server.app.post("/noop")
    async def noop() -> dict[str, bool]:
        return {"ok": True}

    requests = [
        RunRequest(step=1, item_index=index, run_id=0, group_id=f"g{index}", task_id=str(index), item={"a": 1, "b": 2}, seed=index)
        for index in range(episodes)
    ]
    book.register(requests, SamplingDefaults(max_tokens=8, temperature=1.0))
    print(server.start(), flush=True)
    sys.stdin.read()
    book.close()
    server.stop()
    store.close()


class Connection:
    """One keep-alive HTTP/1.1 connection that posts JSON and reads JSON answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, host)

    async def post(self, path: str, body: bytes, key: str | None = None) -> dict:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{auth}Content-Length: {len(body)}\r\n\r\n"
        self.writer.write(head.encode("ascii") + body)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        if not status_line.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{path}: {status_line!r} {payload[:200]!r}")
        return json.loads(payload)

    def close(self) -> None:
        self.writer.close()


async def episode_cycle(connection: Connection) -> None:
    claim = await connection.post("/claim_episode", b'{"client_id": "bench"}')
    if not claim.get("episode_id"):
        raise RuntimeError("the server ran out of episodes; raise --episodes")
    body = json.dumps({"episode_id": claim["episode_id"], "reward": 1.0}).encode()
    await connection.post("/end_episode", body, claim["api_key"])


async def noop_cycle(connection: Connection) -> None:
    await connection.post("/noop", b'{"client_id": "bench"}')
    await connection.post("/noop", b'{"episode_id": "0123456789abcdef0123456789abcdef", "reward": 1.0}')


async def measure(url: str, clients: int, seconds: float, rounds: int) -> tuple[float, float]:
    """Cycles/s of the no-op side and the episode side, each measured in ``rounds`` alternating
    turns of ``seconds / rounds`` on the same ``clients`` connections, so load that other
    work puts on a shared machine meanwhile falls on both sides alike."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connections = [await Connection.open(host, int(port)) for _ in range(clients)]

    async def turn(cycle, length: float) -> int:
        counts = [0] * clients

        async def client(index: int, until: float) -> None:
            while time.monotonic() < until:
                await cycle(connections[index])
                counts[index] += 1

        until = time.monotonic() + length
        await asyncio.gather(*(client(index, until) for index in range(clients)))
        return sum(counts)

    warm = min(1.0, seconds / 3)
    for cycle in (noop_cycle, episode_cycle):
        await turn(cycle, warm)
    done = {noop_cycle: 0, episode_cycle: 0}
    spent = {noop_cycle: 0.0, episode_cycle: 0.0}
    for _ in range(rounds):
        for cycle in (noop_cycle, episode_cycle):
            start = time.monotonic()
            done[cycle] += await turn(cycle, seconds / rounds)
            spent[cycle] += time.monotonic() - start
    for connection in connections:
        connection.close()
    return done[noop_cycle] / spent[noop_cycle], done[episode_cycle] / spent[episode_cycle]


def main() -> None:
    parser = argparse.ArgumentParser(description="Episode server claim+end cycles/s vs a no-op endpoint")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (connections)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per side, after a warm-up")
    parser.add_argument("--rounds", type=int, default=5, help="alternating turns per side (1: one block each, no-op first)")
    parser.add_argument("--episodes", type=int, default=60_000, help="episodes queued for the episode side")
    parser.add_argument("--serve", nargs=2, metavar=("DB", "EPISODES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    with tempfile.TemporaryDirectory() as directory:
        database = Path(directory) / "episodes.db"
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(database), str(args.episodes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            url = child.stdout.readline().strip()
            if not url:
                raise SystemExit("the server did not start")
            ceiling, episodes = asyncio.run(measure(url, args.clients, args.seconds, args.rounds))
        finally:
            child.stdin.close()
            child.wait(timeout=30)
    ratio = episodes / ceiling
    print(
        f"clients: {args.clients}, {args.seconds:g} s per side in {args.rounds} alternating turn(s), "
        "server: uvicorn + FastAPI, store: SQLite (WAL)"
    )
    print(f"no-op endpoint (ceiling):  {ceiling:8.0f} cycles/s (2 requests each)")
    print(f"episode claim+end:         {episodes:8.0f} cycles/s")
    print(f"ratio: {ratio:.0%} of the ceiling (target >= {TARGET:.0%}): {'PASS' if ratio >= TARGET else 'FAIL'}")


if __name__ == "__main__":
    main()
