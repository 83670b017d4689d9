"""gemmtune's version: part of every device fingerprint and of every store entry."""

__version__ = "0.1.0"
