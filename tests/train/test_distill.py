"""On-policy distillation in the actor: the teacher kinds give the same numbers, the two modes the
same first update, and a teacher that cannot score given token ids is refused with the reason."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.adam_compare import adam_denominators, assert_adamw_weights_agree
from tests.toy import toy_groups
from weir.config import build_config
from weir.config.sections import DistillConfig
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.teacher import EndpointTeacher, TeacherError, check_teacher_tokenizer


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from weir.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "t", size="nano", seed=3)


def _actor(model_dir, *opts: str) -> Actor:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = build_config({}, ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", *opts])
    return Actor(model, ActorSettings.from_config(cfg))


def _batch(actor: Actor):
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch) * batch.response_mask
    return batch


class _Server:
    """A stand-in OpenAI-compatible server scoring prompts with a real model, in vLLM's
    `prompt_logprobs` format (`style="vllm"`), the OpenAI echo format (`"echo"`), echo with text
    tokens instead of ids (`"text"`), or no log-probs at all (`"none"`)."""

    def __init__(self, model_dir, style: str):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.style = style
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send({"data": [{"id": "teacher"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(server.answer(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, body):
        ids = body["prompt"]
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
        lp = logits.log_softmax(-1)
        values = [None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
        if self.style == "vllm":
            plp = [None] + [
                {str(ids[i]): {"logprob": values[i], "rank": 1}} for i in range(1, len(ids))
            ]
            return {"choices": [{"text": "x", "prompt_logprobs": plp, "logprobs": None}]}
        if self.style == "none":
            return {"choices": [{"text": "x", "logprobs": None}]}
        tokens = [f"token_id:{i}" if self.style == "echo" else chr(65 + i % 26) for i in ids]
        return {
            "choices": [{"text": "x", "logprobs": {"tokens": tokens, "token_logprobs": values}}]
        }

    def close(self):
        self.httpd.shutdown()


@pytest.mark.parametrize("style", ["vllm", "echo"])
def test_served_teacher_gives_the_local_teachers_numbers(tiny_model_dir, teacher_dir, style):
    local = _actor(tiny_model_dir, f"algo.distill.teacher={teacher_dir}")
    batch = _batch(local)
    expected = local.teacher.logprobs(batch)
    server = _Server(teacher_dir, style)
    try:
        served = _actor(tiny_model_dir, f"algo.distill.teacher={server.url}")
        assert served.teacher.model == "teacher"  # the first of /v1/models
        got = served.teacher.logprobs(batch)
    finally:
        server.close()
    m = batch.response_mask.bool()
    assert (expected[m] < -0.1).all()  # real log-probs, not zeros
    torch.testing.assert_close(got[m], expected[m], atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "style, why",
    [("none", "no per-token log-probs of the prompt"), ("text", "other tokens than the ids sent")],
)
def test_an_endpoint_that_cannot_score_ids_is_refused(teacher_dir, style, why):
    server = _Server(teacher_dir, style)
    try:
        with pytest.raises(TeacherError, match=why) as err:
            EndpointTeacher(server.url, DistillConfig(teacher=server.url))
    finally:
        server.close()
    assert "\n" not in str(err.value)


def test_no_server_is_one_line():
    with pytest.raises(TeacherError, match="no answer from /v1/models"):
        EndpointTeacher("http://127.0.0.1:9", DistillConfig(endpoint_timeout_s=2.0))


def test_advantage_and_loss_modes_take_the_same_first_update(tiny_model_dir, teacher_dir):
    """At ratio 1 the PPO term's gradient -A grad logp with A = -k equals the loss term's
    k grad logp: the same gradient, so the same AdamW step."""
    after = {}
    for mode in ("advantage", "loss"):
        actor = _actor(
            tiny_model_dir, f"algo.distill.teacher={teacher_dir}", f"algo.distill.mode={mode}"
        )
        stats = actor.train(_batch(actor))
        assert stats["distill/reverse_kl"] != 0
        params = list(actor.model.parameters())
        after[mode] = (
            stats["train/grad_norm"],
            torch.cat([p.detach().reshape(-1) for p in params]),
            adam_denominators(actor.optimizer, params),
        )
    assert after["advantage"][0] == pytest.approx(after["loss"][0], rel=1e-5)
    # the two gradients differ by rounding (another order of the same sums): AdamW's first step
    # lr * g / (|g| + eps) is compared where |g| is well above eps (tests/adam_compare.py)
    assert_adamw_weights_agree(
        after["advantage"][1],
        after["loss"][1],
        torch.minimum(after["advantage"][2], after["loss"][2]),
        lr=1e-3,
    )


def test_the_reference_as_teacher_of_itself_moves_nothing(tiny_model_dir):
    """The student equals its teacher (the reference, at the student's temperature 1): every
    reverse KL is 0, so with no task reward the gradient is 0 up to the rounding between the
    student's and the teacher's forward passes (a few 1e-6; a real teacher gives ~1.3 here)."""
    actor = _actor(tiny_model_dir, "algo.distill.teacher=reference")
    stats = actor.train(_batch(actor))
    assert stats["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["train/grad_norm"] == pytest.approx(0.0, abs=1e-4)


def test_a_teacher_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path)
    with pytest.raises(TeacherError, match="not the policy's"):
        check_teacher_tokenizer(str(tmp_path), tok)
    check_teacher_tokenizer(tiny_model_dir, tok)  # the same tokenizer passes
