"""The generative judge: against weir's own OpenAI-compatible server (scripted engine) and against
a local fake endpoint that fails, refuses or hangs, with counted requests to prove retries,
timeouts, the concurrency limit and the cache."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import AutoTokenizer

from weir.config import Config
from weir.data.sample import Sample, Status
from weir.engine.base import Completion, SamplingParams
from weir.loop.components import reward_function
from weir.rollout.judge import Judge, get_judge
from weir.rollout.rewards import get_reward, score
from weir.serve import Server


def S(text: str) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[5], response_text=text)


class FakeEndpoint:
    """/v1/chat/completions answering from a script: ("ok", text), ("status", code) or
    ("hang", seconds); the last entry repeats. Counts requests and the most in flight at once."""

    def __init__(self, script, delay: float = 0.0):
        self.script, self.delay = list(script), delay
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append(body)
                    step = fake.script.pop(0) if len(fake.script) > 1 else fake.script[0]
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    time.sleep(fake.delay)
                    kind, arg = step
                    if kind == "hang":
                        time.sleep(arg)
                        return
                    if kind == "status":
                        self._send(arg, {"error": {"message": f"scripted {arg}", "type": "x"}})
                        return
                    self._send(
                        200,
                        {
                            "id": "x",
                            "object": "chat.completion",
                            "created": 0,
                            "model": body["model"],
                            "choices": [
                                {
                                    "index": 0,
                                    "message": {"role": "assistant", "content": arg},
                                    "finish_reason": "stop",
                                }
                            ],
                        },
                    )
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def endpoint():
    made = []

    def make(script, delay=0.0):
        made.append(FakeEndpoint(script, delay))
        return made[-1]

    yield make
    for e in made:
        e.close()


def judge_fn(url, **kw):
    return get_reward(
        "judge", **{"base_url": url, "model": "judge-model", "backoff_s": 0.01, "retries": 2, **kw}
    )


def test_score_parsed_normalized_and_template_rendered(endpoint):
    ep = endpoint([("ok", "Reasoning... Score: 7.5")])
    fn = judge_fn(ep.url, template="Q={prompt} gold={answer} R={response}", system="be strict")
    s = S("eight<|end|>")
    asyncio.run(score(fn, s, {"prompt": "3+5", "answer": "8"}))
    assert s.status == Status.COMPLETED
    assert s.reward == pytest.approx(0.75)  # 7.5 on [0, 10]
    assert s.reward_info["judge_reply"] == "Reasoning... Score: 7.5"
    (req,) = ep.requests
    assert req["model"] == "judge-model" and req["temperature"] == 0.0
    assert req["messages"] == [
        {"role": "system", "content": "be strict"},
        {"role": "user", "content": "Q=3+5 gold=8 R=eight"},
    ]


def test_transient_failures_are_retried(endpoint):
    ep = endpoint([("status", 500), ("status", 429), ("ok", "Score: 3")])
    fn = judge_fn(ep.url, template="{response}")
    s = S("a")
    asyncio.run(score(fn, s, {}))
    assert s.status == Status.COMPLETED and s.reward == pytest.approx(0.3)
    assert len(ep.requests) == 3


def test_retries_are_bounded_and_the_failure_counted(endpoint):
    ep = endpoint([("status", 503)])
    fn = judge_fn(ep.url, template="{response} bounded")
    s = S("a")
    asyncio.run(score(fn, s, {}))
    assert s.status == Status.FAILED and s.reward is None
    assert "failed 3 time(s)" in s.error and "InternalServerError" in s.error
    assert len(ep.requests) == 3  # 1 + retries=2


def test_client_errors_are_not_retried(endpoint):
    ep = endpoint([("status", 400)])
    fn = judge_fn(ep.url, template="{response} 400")
    s = S("a")
    asyncio.run(score(fn, s, {}))
    assert s.status == Status.FAILED and "refused the request (400)" in s.error
    assert len(ep.requests) == 1


def test_a_hanging_endpoint_times_out_and_is_retried(endpoint):
    # a timeout well above a loaded machine's reply time for "ok", well below the hang
    ep = endpoint([("hang", 8.0), ("ok", "10")])
    fn = judge_fn(ep.url, template="{response} hang", timeout_s=2.0)
    s = S("a")
    start = time.perf_counter()
    asyncio.run(score(fn, s, {}))
    assert time.perf_counter() - start < 7.0
    assert s.reward == pytest.approx(1.0) and len(ep.requests) == 2
    ep2 = endpoint([("hang", 3.0)])
    fn = judge_fn(ep2.url, template="{response} hang", timeout_s=0.2, retries=1)
    s = S("a")
    asyncio.run(score(fn, s, {}))
    assert s.status == Status.FAILED and "Timeout" in s.error
    assert len(ep2.requests) == 2


def test_unparseable_or_out_of_range_reply_fails_the_sample(endpoint):
    for reply, message in (("no idea", "holds no score"), ("Score: 11", "outside [0.0, 10.0]")):
        ep = endpoint([("ok", reply)])
        s = S("a")
        asyncio.run(score(judge_fn(ep.url, template="{response}" + reply), s, {}))
        assert s.status == Status.FAILED and message in s.error


def test_regex_rule_and_raw_scale(endpoint):
    ep = endpoint([("ok", "1. fine 2. VERDICT=-2 (of -5..5)")])
    fn = judge_fn(
        ep.url,
        template="{response} regex",
        pattern=r"VERDICT=(-?\d+)",
        min_score=-5,
        max_score=5,
        normalize=False,
    )
    s = S("a")
    asyncio.run(score(fn, s, {}))
    assert s.reward == -2.0


def test_concurrency_limit(endpoint):
    ep = endpoint([("ok", "5")], delay=0.15)
    fn = judge_fn(ep.url, template="{response} conc", max_concurrency=2)

    async def many():
        samples = [S(f"r{i}") for i in range(6)]
        await asyncio.gather(*(score(fn, s, {}) for s in samples))
        return samples

    samples = asyncio.run(many())
    assert [s.reward for s in samples] == [0.5] * 6
    assert len(ep.requests) == 6 and ep.max_in_flight == 2


def test_cache_in_memory_and_on_disk(endpoint, tmp_path):
    ep = endpoint([("ok", "6")])
    cache = tmp_path / "judge.jsonl"
    opts = dict(base_url=ep.url, model="m", template="{response} cache", cache_path=str(cache))
    fn = get_reward("judge", **opts)
    for text in ("same", "same", "other", "same"):
        asyncio.run(score(fn, S(text), {}))
    judge = get_judge(**opts)
    assert len(ep.requests) == 2 and judge.requests == 2 and judge.cache_hits == 2
    # a new process (a fresh Judge) reads the file and asks nothing
    fresh = Judge(**opts)
    out = asyncio.run(fresh({}, "same"))
    assert out == {"reward": 0.6, "judge_reply": "6", "judge_cached": True}
    assert fresh.requests == 0 and len(ep.requests) == 2
    # the key includes the model: another judge model is asked again
    other = Judge(**{**opts, "model": "m2"})
    asyncio.run(other({}, "same"))
    assert other.requests == 1 and len(ep.requests) == 3


def test_misconfigured_judge_is_refused_at_build():
    for kwargs, message in (
        ({"model": "m"}, "base_url"),
        ({"base_url": "http://x/v1", "model": "m", "template": "{response"}, "does not parse"),
        ({"base_url": "http://x/v1", "model": "m", "pattern": "("}, "not a valid regex"),
        ({"base_url": "http://x/v1", "model": "m", "retires": 3}, "retires"),
    ):
        cfg = Config.model_validate({"reward": {"function": "judge", "kwargs": kwargs}})
        with pytest.raises(ValueError, match=message):
            reward_function(cfg)


class ScriptedEngine:
    """An engine answering each request with the next queued text; keeps the prompts it got."""

    def __init__(self, tokenizer):
        self.tokenizer, self.eos_token_ids = tokenizer, [tokenizer.eos_token_id]
        self.replies: list[str] = []
        self.prompts: list[list[int]] = []
        self.version, self.max_seq_len = 0, 512

    async def generate(self, prompt_ids, params: SamplingParams) -> list[Completion]:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        ids = (ids + self.eos_token_ids)[: params.max_new_tokens]
        return [Completion(ids, [-0.1] * len(ids), [0] * len(ids), "stop")]

    async def update_weights(self, named_tensors, version):
        pass

    async def pause(self):
        pass

    async def resume(self):
        pass

    async def abort(self):
        pass


def test_against_weirs_own_server(tiny_model_dir, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tokenizer)
    engine.replies = ["Score: 9", "Score: 2"]
    monkeypatch.setenv("WEIR_TEST_JUDGE_KEY", "judge-key")  # the server wants a bearer key
    with Server(engine, tokenizer, model_name="tiny-judge", admin_key="judge-key") as srv:
        fn = get_reward(
            "judge",
            base_url=srv.base_url,
            model="tiny-judge",
            api_key_env="WEIR_TEST_JUDGE_KEY",
            template="Is {response} the answer to {prompt}?",
        )
        samples = [S("8"), S("9")]
        for s in samples:
            asyncio.run(score(fn, s, {"prompt": "3+5"}))
    assert [s.reward for s in samples] == [pytest.approx(0.9), pytest.approx(0.2)]
    seen = tokenizer.decode(engine.prompts[0])
    assert "Is 8 the answer to 3+5?" in seen
