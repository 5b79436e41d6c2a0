"""An agent behind a URL: AG-UI runs over server-sent events, served under Trio.

Needs the ``web`` extra (``pip install 'trio_agent[web]'``: Starlette and Hypercorn)::

    import trio
    from trio_agent.web import create_app, local_only, serve
    from trio_agent.testing import Reply, TestModel

    app = create_app(TestModel(default=Reply(text="hello")), auth=local_only)
    trio.run(lambda: serve(app, port=8000))

``POST /runs`` takes AG-UI's ``RunAgentInput`` and streams the run's AG-UI events;
``POST /runs/{run_id}/abort`` stops a run. See ``docs/web.md``.
"""

from __future__ import annotations

try:
    import hypercorn  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is installed in our tests
    raise ImportError(
        "trio_agent.web needs the web extra (Starlette and Hypercorn): pip install 'trio_agent[web]'"
    ) from exc

from ._agui._input import InputError, ResumeEntry, RunInput, answers_for, parse_run_input
from ._util import fixup_module_metadata as _fixup_module_metadata
from ._web._app import Auth, bearer_token, create_app, local_only
from ._web._serve import serve

__all__ = [
    "Auth",
    "InputError",
    "ResumeEntry",
    "RunInput",
    "answers_for",
    "bearer_token",
    "create_app",
    "local_only",
    "parse_run_input",
    "serve",
]

_fixup_module_metadata(__name__, globals())
