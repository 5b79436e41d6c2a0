"""A worker process for the session crash test (``tests/test_session_durable.py``)."""
