"""An OpenAI-compatible server in front of a weir engine that records every token, per session.

An agent written against the `openai` client runs unchanged against `Server`; each session's calls
become one token-exact trajectory (`Session.to_samples()`), and `agent_rollout` turns such an agent
into a weir rollout function. Needs the ``serve`` extra (``pip install 'weir[serve]'``).
"""

try:
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"weir.serve needs FastAPI and uvicorn ({err}); install them with: pip install 'weir[serve]'"
    ) from None

from weir.serve.agent import agent_rollout  # noqa: E402
from weir.serve.server import Server  # noqa: E402
from weir.serve.sessions import Session, SessionManager  # noqa: E402

__all__ = ["Server", "Session", "SessionManager", "agent_rollout"]
