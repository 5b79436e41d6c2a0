"""Face 1 of the one agent loop: ``chat()``, a run without a session."""
