"""Ranks working together: process groups, collectives, agreement, faults, signals.

The lowest layer of the package: it imports only torch and ``_C``, and every layer
above uses it (docs/architecture.md).
"""
