"""AG-UI: the loop's events in the Agent User Interaction protocol (public face: `trio_agent.agui`)."""
