"""Tools: definitions, behaviour, the execution pipeline, scheduler and file locks."""
