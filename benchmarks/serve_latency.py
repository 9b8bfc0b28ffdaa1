"""Tail latency of `weir serve` under many concurrent sessions, through the real `openai` client.

`weir serve` runs in a process of its own (the tiny model, loopback); this process opens `--sessions`
recorded sessions over HTTP and runs them all at once, each a `--turns`-turn chat (every turn sends the
conversation so far plus a new user message, as an agent does). Each call's latency is measured at
the client. Prints requests/s, p50, p90, p99 and p99/p50 against the target (p99 <= 3 x p50), per
round; `--rounds` repeats the whole load on the same server (the first round includes the engine's
warm-up).

    .venv/bin/python benchmarks/serve_latency.py                      # 256 sessions x 2 turns
    .venv/bin/python benchmarks/serve_latency.py --sessions 64 --rounds 3
    .venv/bin/python benchmarks/serve_latency.py --override engine.schedule=fifo   # the old order

Say the machine and its load (`uptime`) beside any figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time

TARGET = 3.0  # p99 <= TARGET x p50


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: str, port: int, admin: str, overrides: list[str], root: str | None = None
) -> subprocess.Popen:
    """`weir serve` in a process of its own; with `root`, weir imported from that checkout."""
    cmd = [sys.executable, "-m", "weir.cli.main", "serve", model, f"serve.port={port}", *overrides]
    env = {**os.environ, "WEIR_ADMIN_KEY": admin}
    if root:
        env["PYTHONPATH"] = root
    proc = subprocess.Popen(
        cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for line in proc.stdout:
        if line.startswith("serving "):
            return proc
    raise RuntimeError(f"weir serve did not start (exit {proc.wait()})")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))]


async def open_session(http, openai, base: str, admin: str, i: int):
    r = await http.post(
        f"{base}/v1/sessions", headers={"Authorization": f"Bearer {admin}"}, json={"row": {"i": i}}
    )
    r.raise_for_status()
    s = r.json()
    return openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], http_client=http)


async def one_session(client, turns: int, i: int, max_tokens: int) -> list[tuple[int, float]]:
    out: list[tuple[int, float]] = []
    messages = [{"role": "user", "content": f"What is {i} + {i % 7}?"}]
    for turn in range(turns):
        t0 = time.perf_counter()
        reply = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=max_tokens, temperature=1.0
        )
        out.append((turn, time.perf_counter() - t0))
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": "And then add 1?"},
        ]
    return out


async def own_client_session(base: str, admin: str, turns: int, i: int, max_tokens: int):
    """A session that opens itself and makes its own client (own connections) inside the burst."""
    import httpx
    import openai

    async with httpx.AsyncClient(timeout=600) as http:
        r = await http.post(
            f"{base}/v1/sessions", headers={"Authorization": f"Bearer {admin}"}, json={"row": {}}
        )
        s = r.json()
    async with openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"]) as client:
        return await one_session(client, turns, i, max_tokens)


async def round_(
    base: str, admin: str, sessions: int, turns: int, max_tokens: int, setup: str = "before"
) -> dict:
    """`setup="before"`: open every session (and its client, on one shared connection pool) first,
    then run them all at once, so the clock measures the calls. `"inside"`: each session opens
    itself and builds its own client inside the burst (a client's construction, ~10-50 ms of this
    process's CPU each, then holds up this event loop while other sessions' calls are timed)."""
    import httpx
    import openai

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        if setup == "inside":
            runs = [own_client_session(base, admin, turns, i, max_tokens) for i in range(sessions)]
        else:
            clients = [await open_session(http, openai, base, admin, i) for i in range(sessions)]
            runs = [one_session(c, turns, i, max_tokens) for i, c in enumerate(clients)]
        t0 = time.perf_counter()
        got = await asyncio.gather(*runs, return_exceptions=True)
        wall = time.perf_counter() - t0
    failed = [g for g in got if isinstance(g, BaseException)]
    lat = [t for g in got if not isinstance(g, BaseException) for _, t in g]
    by_turn = {
        k: [t for g in got if not isinstance(g, BaseException) for turn, t in g if turn == k]
        for k in range(turns)
    }
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    return {
        "ok": len(lat),
        "failed": len(failed),
        "first_error": repr(failed[0]) if failed else "",
        "wall": wall,
        "rps": len(lat) / wall,
        "p50": p50,
        "p90": percentile(lat, 90),
        "p99": p99,
        "ratio": p99 / p50,
        "turns": {k: (statistics.median(v), percentile(v, 99)) for k, v in by_turn.items() if v},
    }


def report(name: str, r: int, res: dict) -> None:
    verdict = "meets" if res["ratio"] <= TARGET else "misses"
    turns = "  ".join(f"turn {k + 1} p50 {m:.2f} p99 {p:.2f}" for k, (m, p) in res["turns"].items())
    print(
        f"{name} round {r + 1}: {res['ok']} ok, {res['failed']} failed, {res['rps']:.1f} req/s, "
        f"p50 {res['p50']:.2f} s, p90 {res['p90']:.2f} s, p99 {res['p99']:.2f} s, "
        f"p99/p50 {res['ratio']:.2f} ({verdict} the target <= {TARGET:g}); {turns}",
        flush=True,
    )
    if res["failed"]:
        print(f"  first error: {res['first_error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="tiny:tiny")
    ap.add_argument("--override", action="append", default=[], help="weir serve override")
    ap.add_argument(
        "--client-setup",
        choices=["before", "inside"],
        default="before",
        help="make the sessions' clients before the clock (default) or inside the burst",
    )
    ap.add_argument(
        "--baseline",
        help="another weir checkout (e.g. a `git worktree` of an older commit): its server is run "
        "too, the rounds alternating between the two",
    )
    args = ap.parse_args()

    admin = secrets.token_hex(16)
    servers = {"this": (None, free_port())}
    if args.baseline:
        servers["baseline"] = (os.path.abspath(args.baseline), free_port())
    procs = [
        start_server(args.model, port, admin, args.override, root)
        for root, port in servers.values()
    ]
    print(
        f"weir serve {args.model} {' '.join(args.override)}: {args.sessions} sessions x "
        f"{args.turns} turns, max_tokens {args.max_tokens}, clients made {args.client_setup} the "
        f"burst; load {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    try:
        for r in range(args.rounds):
            order = list(servers.items())
            for name, (_, port) in order if r % 2 == 0 else order[::-1]:  # alternating, ABBA
                base = f"http://127.0.0.1:{port}"
                res = asyncio.run(
                    round_(
                        base, admin, args.sessions, args.turns, args.max_tokens, args.client_setup
                    )
                )
                report(name, r, res)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
