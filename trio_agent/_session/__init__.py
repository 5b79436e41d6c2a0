"""Sessions: plugins, hook events, permissions and subagents."""
