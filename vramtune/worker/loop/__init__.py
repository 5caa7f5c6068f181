"""The agent loop: the server client, register → next → plan → run → report, heartbeats, the
spool and delivery of final calls, planning ahead, and the packing loop."""
