"""Serving: the hot path from a call to its tuned kernel, the custom ops, recording."""
