"""Fairness under a burst: calls reach the engine in the order they arrive, each without waiting
for the calls behind it to be handled (benchmarks/serve_latency.py measures the latency this buys).

Before: the server's authentication dependencies were plain functions, which FastAPI runs in worker
threads; every call suspended at them, so a burst of N calls was handled round-robin: each reached
the engine only once all N had been parsed and authenticated, in the order threads happened to
finish, and a session's second turn, arriving during another burst, waited for all of it.
"""

from __future__ import annotations

import asyncio
import re

import httpx

from weir.serve import Server
from weir.serve.app import create_app
from weir.serve.server import BodyLimit


class Recorder:
    """ASGI wrapper counting the calls that have entered the app."""

    def __init__(self, app):
        self.app, self.entered = app, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            self.entered += 1
        await self.app(scope, receive, send)


class OrderEngine:
    """Answers at once; records, for each prompt it is given, how many calls had entered the app."""

    def __init__(self, tokenizer, recorder_box):
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.version, self.max_seq_len = 0, 512
        self.seen: list[tuple[list[int], int]] = []
        self.box = recorder_box

    async def generate(self, prompt_ids, params):
        from weir.engine.base import Completion

        self.seen.append((list(prompt_ids), self.box[0].entered))
        await asyncio.sleep(0)
        ids = self.eos_token_ids
        return [Completion(list(ids), [-0.5], [0], "stop") for _ in range(params.n)]


def test_a_burst_reaches_the_engine_in_arrival_order_without_round_robin(tokenizer):
    box: list[Recorder] = []
    engine = OrderEngine(tokenizer, box)
    server = Server(engine, tokenizer)  # not started: the app is called in this event loop
    recorder = Recorder(BodyLimit(create_app(server.state), server.config.max_body_bytes))
    box.append(recorder)
    sessions = [server.sessions.open({"k": k}) for k in range(16)]

    async def burst(turn: int) -> None:
        transport = httpx.ASGITransport(app=recorder)
        async with httpx.AsyncClient(transport=transport, base_url="http://weir") as client:

            async def call(k: int):
                messages = [{"role": "user", "content": f"question {k}"}]
                for t in range(turn):
                    messages += [
                        {"role": "assistant", "content": ""},
                        {"role": "user", "content": f"more {k} {t}"},
                    ]
                r = await client.post(
                    "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {sessions[k].api_key}"},
                    json={"model": "weir", "messages": messages, "max_tokens": 4},
                )
                assert r.status_code == 200, r.text

            await asyncio.gather(*(call(k) for k in range(len(sessions))))

    for turn in (0, 1):  # first turns, then every session's second turn at once
        before, start = recorder.entered, len(engine.seen)
        asyncio.run(burst(turn))
        seen = engine.seen[start:]
        word = "more" if turn else "question"
        order = [int(re.findall(rf"{word} (\d+)", tokenizer.decode(ids))[-1]) for ids, _ in seen]
        assert order == list(range(len(sessions)))
        # the k-th call reached the engine before the calls behind it were even handled
        assert [entered - before for _, entered in seen] == list(range(1, len(sessions) + 1))
