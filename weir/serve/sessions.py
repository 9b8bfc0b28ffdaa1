"""Sessions: one agent episode each, with its own API key, recorded turn by turn.

weir opens a session (`SessionManager.open(row)`) and gives the agent ``base_url`` and the session's
``api_key``; every call the agent makes with that key is recorded in the session (prompt ids,
response ids, log-probs, versions) and linked into one trajectory (see `weir.serve.trajectory`). A
key reaches its own session only. The agent or the environment sets the reward (HTTP
``POST /v1/sessions/{id}/reward`` or `Session.set_reward`), and `Session.to_samples()` turns the
recording into training samples.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from weir.data.sample import Sample
from weir.engine.base import SamplingParams
from weir.serve.trajectory import Turn, extends, segment_sample, segments


@dataclass
class Session:
    """One recorded episode. Thread-safe: the server records while other threads read."""

    id: str
    api_key: str
    base_url: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingParams | None = None  # when set, overrides the client's sampling settings
    loop: asyncio.AbstractEventLoop | None = None  # where to run the engine's generate, if pinned
    reward: float | None = None
    reward_info: dict[str, Any] = field(default_factory=dict)
    closed: bool = False
    turns: list[Turn] = field(default_factory=list)
    _mu: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _call_lock: asyncio.Lock | None = field(default=None, repr=False)

    def call_lock(self) -> asyncio.Lock:
        """Serialises this session's model calls (created on the server's event loop)."""
        if self._call_lock is None:
            self._call_lock = asyncio.Lock()
        return self._call_lock

    @property
    def last_turn(self) -> Turn | None:
        with self._mu:
            return self.turns[-1] if self.turns else None

    def record(self, turn: Turn) -> Turn:
        """Append `turn`: it continues the latest segment if its prompt extends the latest turn's
        prompt + response, else it opens a new segment."""
        with self._mu:
            last = self.turns[-1] if self.turns else None
            if last is None:
                turn.segment, turn.link = 0, "start"
            elif extends(turn.prompt_ids, last.context):
                turn.segment, turn.link = last.segment, "extend"
            else:
                turn.segment = last.segment + 1
                if not turn.link.startswith("new"):
                    turn.link = "new: the prompt does not extend the previous prompt + response"
            self.turns.append(turn)
        return turn

    def set_reward(self, reward: float, info: dict[str, Any] | None = None) -> None:
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"session reward must be a finite number, got {reward}")
        with self._mu:
            self.reward = reward
            self.reward_info = dict(info or {})

    def close(self) -> None:
        """Refuse further calls with this session's key (the recording stays readable)."""
        self.closed = True

    @property
    def num_segments(self) -> int:
        with self._mu:
            return len({t.segment for t in self.turns})

    def to_samples(self) -> list[Sample]:
        """One `Sample` per segment, each with the session's reward, row and metadata."""
        with self._mu:
            turns = list(self.turns)
            reward, info = self.reward, dict(self.reward_info)
        samples = []
        for seg in segments(turns):
            s = segment_sample(
                seg,
                reward=reward,
                reward_info=dict(info),
                row=self.row,
                metadata={
                    **self.metadata,
                    "session": self.id,
                    "segment": seg[0].segment,
                    "turns": len(seg),
                    "segment_start": seg[0].link,
                },
            )
            samples.append(s)
        return samples

    def to_sample(self) -> Sample:
        """The sample of the latest segment (the whole episode when the agent never rewrote its
        history). Raises ValueError when no call was made."""
        samples = self.to_samples()
        if not samples:
            raise ValueError(f"session {self.id} recorded no model call")
        return samples[-1]

    def summary(self) -> dict[str, Any]:
        with self._mu:
            return {
                "id": self.id,
                "closed": self.closed,
                "reward": self.reward,
                "reward_info": self.reward_info,
                "turns": [
                    {
                        "segment": t.segment,
                        "link": t.link,
                        "prompt_tokens": len(t.prompt_ids),
                        "completion_tokens": len(t.response_ids),
                        "finish_reason": t.finish_reason,
                    }
                    for t in self.turns
                ],
            }


class SessionManager:
    """Creates sessions and finds them by API key. `admin_key` may open sessions over HTTP."""

    def __init__(self, base_url: str = "", admin_key: str | None = None):
        self.base_url = base_url
        self.admin_key = admin_key or "weir-admin-" + secrets.token_urlsafe(24)
        self._by_key: dict[str, Session] = {}
        self._by_id: dict[str, Session] = {}
        self._mu = threading.Lock()

    def open(
        self,
        row: dict[str, Any] | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        sampling: SamplingParams | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Session:
        """A new session with a fresh id and key. `sampling` (temperature, top-p, top-k, and
        max_new_tokens as a cap) overrides what the agent asks for, so that the recorded log-probs
        follow the trainer's convention; `loop` pins the engine calls to that event loop."""
        session = Session(
            id="sess-" + secrets.token_hex(12),
            api_key="weir-" + secrets.token_urlsafe(32),
            base_url=self.base_url,
            row=dict(row or {}),
            metadata=dict(metadata or {}),
            sampling=sampling,
            loop=loop,
        )
        with self._mu:
            self._by_key[session.api_key] = session
            self._by_id[session.id] = session
        return session

    def by_key(self, key: str) -> Session | None:
        with self._mu:
            return self._by_key.get(key)

    def get(self, session_id: str) -> Session | None:
        with self._mu:
            return self._by_id.get(session_id)

    def remove(self, session: Session) -> None:
        """Close `session` and forget it (its key stops working; the object keeps its recording)."""
        session.close()
        with self._mu:
            self._by_key.pop(session.api_key, None)
            self._by_id.pop(session.id, None)

    def __len__(self) -> int:
        with self._mu:
            return len(self._by_id)
