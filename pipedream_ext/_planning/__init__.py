"""Profiling and planning: timing layers, profile graphs of ``nn.Sequential`` and
traced models, and planning at start-up (``balance="auto"``, plan files).

May import the layers below it (``_frontend``, ``_dist``, ``planner``, ``_C``):
docs/architecture.md.
"""
