"""The generic middleware composer, for library authors.

`compose_middleware` chains ``async def mw(request, call_next)`` layers around a terminal
handler; tool middleware (`trio_agent.ToolMiddleware`) and the wrappers of model middleware
(`trio_agent.ModelMiddleware`) are built on it, and `MiddlewareNext` is what their
``call_next`` is::

    from trio_agent.middleware import Middleware, compose_middleware
"""

from __future__ import annotations

from ._errors import MiddlewareShapeError, NextCalledTwiceError
from ._middleware import Middleware, MiddlewareNext, compose_middleware
from ._util import fixup_module_metadata as _fixup_module_metadata

__all__ = ["Middleware", "MiddlewareNext", "MiddlewareShapeError", "NextCalledTwiceError", "compose_middleware"]

_fixup_module_metadata(__name__, globals())
