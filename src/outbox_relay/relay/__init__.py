"""Relay: moves committed outbox rows into Redis Streams exactly once per event."""
