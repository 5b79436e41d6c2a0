"""Permissions: the rules (`_rules`), the pure decision table (`_table`) and the session's engine (`_engine`)."""
