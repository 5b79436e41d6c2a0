"""The durable journal: events, the sans-I/O projection and the recovery plan."""
