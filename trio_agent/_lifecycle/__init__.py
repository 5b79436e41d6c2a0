"""Chat middleware: the lifecycle hooks of `chat()` as a class users subclass (see `trio_agent.lifecycle`)."""
