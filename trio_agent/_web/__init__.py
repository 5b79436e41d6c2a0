"""The web face: an ASGI app of AG-UI runs (public face: `trio_agent.web`)."""
