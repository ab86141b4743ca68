"""Tuning: the machine's rates that default plans depend on (later: bandwidth curves, the performance model,
plan search and the on-disk plan cache)."""
