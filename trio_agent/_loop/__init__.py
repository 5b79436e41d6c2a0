"""The one agent loop (rules in `_rules.py`, the driver in `_run.py`); it imports no session, journal or AG-UI."""
