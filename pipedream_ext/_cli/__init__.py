"""The command-line interface, one module per command (``python -m pipedream_ext``).

Each module exposes ``register(subparsers)``; ``__main__`` assembles them. May import
every layer below it (``_checkpoint``, ``_planning``, ``schedules``, ``planner``...).
"""
