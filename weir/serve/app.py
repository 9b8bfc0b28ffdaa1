"""The FastAPI application: OpenAI-compatible endpoints over one weir `Engine`, recording sessions.

Endpoints (all need ``Authorization: Bearer <key>``; a session's key reaches only that session):

- ``GET  /v1/models``
- ``POST /v1/chat/completions``  (``tools`` -> ``tool_calls``; ``logprobs``; ``stream``)
- ``POST /v1/completions``       (``logprobs``; ``stream``)
- ``POST /v1/sessions``          (admin key: open a session, optionally with the sampling it
  enforces; returns its id and key)
- ``GET  /v1/sessions/{id}``     (summary) and ``GET /v1/sessions/{id}/trajectory`` (token ids, masks,
  log-probs, versions of each segment)
- ``POST /v1/sessions/{id}/reward`` ``{"reward": r, "info": {...}}`` (``{id}`` may be ``current``:
  the session of the key that calls)
- ``DELETE /v1/sessions/{id}``   (end the session: the server forgets it and its key; read the
  trajectory first)

Calls with the admin key are served but not recorded. Errors use the OpenAI envelope
``{"error": {"message": ..., "type": ...}}``: 400 for an invalid request, 401 for a missing or
unknown key, 403 for another session's resources or a closed session, 413 for an oversized body;
an unexpected failure is a 500 whose message names the error type, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import asdict
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from weir.config.schema import ServeConfig
from weir.data.prompts import BadRow
from weir.data.vision import VisionInputs, encode_vision_prompt, processor_of
from weir.engine.base import Completion, Engine, SamplingParams
from weir.serve.chat import (
    ChatFormatter,
    Prompt,
    cut_at_stop,
    history_message,
    template_messages,
)
from weir.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenSessionRequest,
    RewardRequest,
    error_body,
)
from weir.serve.responses import (
    Choice,
    chat_response,
    completion_response,
)
from weir.serve.sessions import Session, SessionManager
from weir.serve.trajectory import Turn

log = logging.getLogger("weir.serve")


class ApiError(HTTPException):
    """An error the client caused (or may retry), with the OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error"):
        super().__init__(status_code=status, detail=message)
        self.type_ = type_


class BodyLimit:
    """ASGI middleware: read the request body up to `limit` bytes; a larger one gets 413."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.limit
        chunks: list[bytes] = []
        size = 0
        while not too_big:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            too_big = size > self.limit
            if not message.get("more_body", False):
                break
        if too_big:
            body = json.dumps(
                error_body(f"request body exceeds the server's limit of {self.limit} bytes")
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 413,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        body = b"".join(chunks)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ServerState:
    """What the routes share: the engine, the tokenizer, the sessions and the limits."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        config: ServeConfig,
        sessions: SessionManager,
        model_name: str,
        stop_ids: list[int],
        allow_remote_images: bool = False,
    ):
        self.allow_remote_images = allow_remote_images
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.sessions = sessions
        self.model_name = model_name
        self.stop_ids = stop_ids
        self.formatter = ChatFormatter(tokenizer, stop_ids, config.tool_format)

    # -- sampling ------------------------------------------------------------------------------

    def sampling(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        limit: int | None,
        session: Session | None,
    ) -> SamplingParams:
        cfg = self.config
        if limit is None:
            limit = cfg.default_max_tokens
        if limit > cfg.max_tokens:
            raise ApiError(
                400, f"max_tokens={limit} exceeds the server's limit of {cfg.max_tokens}"
            )
        if req.n > cfg.max_n:
            raise ApiError(400, f"n={req.n} exceeds the server's limit of {cfg.max_n}")
        if session is not None and req.n != 1:
            raise ApiError(
                400, "n must be 1 in a session: several completions would fork its trajectory"
            )
        params = SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            max_new_tokens=limit,
            seed=req.seed,
            keep_kv=session is not None,  # a session's next call continues this conversation
        )
        forced = session.sampling if session is not None else None
        if forced is not None:
            params.temperature, params.top_p, params.top_k = (
                forced.temperature,
                forced.top_p,
                forced.top_k,
            )
            params.max_new_tokens = min(limit, forced.max_new_tokens)
            if forced.seed is not None:  # one seed per call: the k-th call of a seeded session
                params.seed = (forced.seed * 1_000_003 + len(session.turns)) % 2**63
        return params

    def vision_prompt(self, messages: list[ChatMessage]) -> tuple[Prompt, VisionInputs | None]:
        """Prompt ids and pixels of a chat with `image_url` parts, through the model's processor."""
        processor = processor_of(self.tokenizer)
        if processor is None:
            raise ApiError(400, "this model takes no images; send text content only")
        chat = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": [p.model_dump() for p in m.content]
                if isinstance(m.content, list)
                else m.text(),
            }
            for m in messages
        ]
        try:
            ids, vision = encode_vision_prompt(
                processor, {"messages": chat}, allow_remote=self.allow_remote_images
            )
        except BadRow as err:
            raise ApiError(400, str(err).removeprefix("row, ")) from None
        return Prompt(ids, "start"), vision

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session: Session | None,
        vision: VisionInputs | None = None,
    ) -> list[Completion]:
        loop = session.loop if session is not None else None
        extra = {"vision": vision} if vision is not None else {}
        try:
            if loop is not None and not loop.is_closed() and loop is not asyncio.get_running_loop():
                fut = asyncio.run_coroutine_threadsafe(
                    self.engine.generate(prompt_ids, params, **extra), loop
                )
                return await asyncio.wrap_future(fut)
            return await self.engine.generate(prompt_ids, params, **extra)
        except ValueError as err:  # the engine's own checks: prompt too long, bad token ids
            raise ApiError(400, str(err)) from None

    def choice(self, c: Completion, stops: list[str] | None) -> Choice:
        ids, lps, vs, finish = (
            list(c.token_ids),
            list(c.logprobs),
            list(c.versions),
            c.finish_reason,
        )
        slps = None if c.sampled_logprobs is None else list(c.sampled_logprobs)
        if stops:
            cut = cut_at_stop(self.tokenizer, ids, stops)
            if cut is not None:
                keep, text = cut
                kept = None if slps is None else slps[:keep]
                return Choice(ids[:keep], lps[:keep], vs[:keep], "stop", text, kept)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Choice(ids, lps, vs, finish, text, slps)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


# -- helpers ---------------------------------------------------------------------------------------


def _bearer(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(
            401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error"
        )
    return key.strip()


# -- the app ---------------------------------------------------------------------------------------


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app serving `state` (wrapped in the body-size limit)."""
    app = FastAPI(title="weir", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.weir = state

    # Starlette's HTTPException, the base of FastAPI's: routing's own 404 (unknown route) and 405
    # (wrong method) and body-decoding errors are raised as Starlette's and must get the envelope too.
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = getattr(exc, "type_", "invalid_request_error")
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors()[:5]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        param = (
            ".".join(str(p) for p in exc.errors()[0].get("loc", ())[1:]) if exc.errors() else None
        )
        return JSONResponse(error_body("invalid request: " + "; ".join(problems), param=param), 400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving %s", request.url.path)
        return JSONResponse(
            error_body(f"internal server error ({type(exc).__name__})", "server_error"), 500
        )

    # The dependencies are `async def`: FastAPI runs a plain `def` one in a worker thread, two thread
    # hops per call that, under a burst of calls, interleave every request's start with all the others.
    async def caller(request: Request) -> Session | None:
        """The caller's session, or None for the admin key; 401 for anything else."""
        key = _bearer(request)
        if secrets.compare_digest(key.encode(), state.sessions.admin_key.encode()):
            return None
        session = state.sessions.by_key(key)
        if session is None:
            raise ApiError(401, "invalid API key", "authentication_error")
        return session

    async def model_caller(session: Session | None = Depends(caller)) -> Session | None:
        if session is not None and session.closed:
            raise ApiError(403, f"session {session.id} is closed", "permission_error")
        return session

    async def owned(session_id: str, session: Session | None = Depends(caller)) -> Session:
        """The session named in the path ("current": the caller's own); 403 for another's."""
        if session_id == "current":
            if session is None:
                raise ApiError(400, "the admin key has no current session; name the session id")
            return session
        if session is not None and session.id != session_id:
            raise ApiError(403, "this API key belongs to another session", "permission_error")
        target = state.sessions.get(session_id)
        if target is None:
            raise ApiError(404, f"no session {session_id!r}", "not_found_error")
        return target

    @app.get("/v1/models")
    async def models(_: Session | None = Depends(caller)) -> dict:
        return {
            "object": "list",
            "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "weir"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, session: Session | None = Depends(model_caller)):
        if len(req.messages) > state.config.max_messages:
            raise ApiError(
                400,
                f"{len(req.messages)} messages exceed the server's limit of {state.config.max_messages}",
            )
        params = state.sampling(req, req.token_limit(), session)
        tools = req.tools_for_template()
        messages = template_messages(req.messages)
        images = any(m.has_images for m in req.messages)
        if images and (session is not None or tools):
            raise ApiError(
                400, "image_url parts are served without sessions or tools; send them to /v1 alone"
            )
        async with _maybe_lock(session):
            last = session.last_turn if session is not None else None
            vision = None
            try:
                if images:
                    prompt, vision = state.vision_prompt(req.messages)
                else:
                    prompt = state.formatter.prompt(messages, tools, last)
            except (TemplateError, ValueError) as err:  # messages the template cannot render
                raise ApiError(
                    400, f"the chat template cannot render these messages: {err}"
                ) from None
            completions = await state.generate(prompt.ids, params, session, vision)
            choices = [state.choice(c, req.stop) for c in completions]
            parsed = [
                state.formatter.assistant(ch.text, tools, ch.token_ids, ch.finish_reason)
                for ch in choices
            ]
            if session is not None:
                content, calls, errors = parsed[0]
                ch = choices[0]
                session.record(
                    Turn(
                        prompt_ids=prompt.ids,
                        response_ids=ch.token_ids,
                        logprobs=ch.logprobs,
                        sampled_logprobs=ch.sampled_logprobs,
                        versions=ch.versions,
                        finish_reason=ch.finish_reason,
                        link=prompt.link,
                        messages=messages + [history_message(content, calls)],
                        output={"tools": tools, "tool_call_errors": errors},
                    )
                )
        return chat_response(state, req, prompt.ids, choices, parsed)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, session: Session | None = Depends(model_caller)):
        params = state.sampling(req, req.max_tokens, session)
        async with _maybe_lock(session):
            last = session.last_turn if session is not None else None
            ids, link = _completion_prompt(state, req.prompt, last)
            completions_ = await state.generate(ids, params, session)
            choices = [state.choice(c, req.stop) for c in completions_]
            if session is not None:
                ch = choices[0]
                client_text = req.prompt + ch.text if isinstance(req.prompt, str) else None
                session.record(
                    Turn(
                        prompt_ids=ids,
                        response_ids=ch.token_ids,
                        logprobs=ch.logprobs,
                        sampled_logprobs=ch.sampled_logprobs,
                        versions=ch.versions,
                        finish_reason=ch.finish_reason,
                        link=link,
                        output={"client_text": client_text},
                    )
                )
        return completion_response(state, req, ids, choices)

    @app.post("/v1/sessions")
    async def open_session(req: OpenSessionRequest, session: Session | None = Depends(caller)):
        if session is not None:
            raise ApiError(403, "only the admin key may open sessions", "permission_error")
        forced = None
        if req.sampling is not None:
            sp = req.sampling
            forced = SamplingParams(
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=sp.top_k,
                max_new_tokens=sp.max_tokens,
                seed=sp.seed,
            )
        s = state.sessions.open(req.row, metadata=req.metadata, sampling=forced)
        return {"id": s.id, "api_key": s.api_key, "base_url": s.base_url}

    @app.get("/v1/sessions/{session_id}")
    async def session_summary(target: Session = Depends(owned)) -> dict:
        return target.summary()

    @app.get("/v1/sessions/{session_id}/trajectory")
    async def trajectory(target: Session = Depends(owned)) -> dict:
        samples = await asyncio.to_thread(target.to_samples)
        keys = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "versions", "status")
        return {
            "id": target.id,
            "reward": target.reward,
            "segments": [
                {k: (v.value if k == "status" else v) for k, v in asdict(s).items() if k in keys}
                for s in samples
            ],
        }

    @app.post("/v1/sessions/{session_id}/reward")
    async def reward(req: RewardRequest, target: Session = Depends(owned)) -> dict:
        target.set_reward(req.reward, req.info)
        return {"id": target.id, "reward": target.reward}

    @app.delete("/v1/sessions/{session_id}")
    async def close(target: Session = Depends(owned)) -> dict:
        state.sessions.remove(target)
        return {"id": target.id, "closed": True}

    return app


class _maybe_lock:
    """`async with` the session's call lock, or nothing for unrecorded (admin) calls."""

    def __init__(self, session: Session | None):
        self.lock = session.call_lock() if session is not None else None

    async def __aenter__(self) -> None:
        if self.lock is not None:
            await self.lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        if self.lock is not None:
            self.lock.release()


def _completion_prompt(
    state: ServerState, prompt: str | list[int], last: Turn | None
) -> tuple[list[int], str]:
    """Token prompts are used as given; a text prompt that starts with the previous call's prompt +
    completion text continues its token ids, with only the new text tokenized."""
    if isinstance(prompt, list):
        return list(prompt), "start"
    before = last.output.get("client_text") if last is not None else None
    if before and len(prompt) > len(before) and prompt.startswith(before):
        added = state.formatter.encode(prompt[len(before) :])
        if added:
            return last.context + added, "extend"
    ids = list(state.tokenizer(prompt)["input_ids"])
    return (
        ids,
        "start" if last is None else "new: the prompt does not continue the previous call's text",
    )
