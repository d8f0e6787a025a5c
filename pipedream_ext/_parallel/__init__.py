"""Parallelism inside a pipeline's stages: the mesh, tensor parallelism and data
parallelism (FSDP, replicas), siblings applied to a stage in one straight line.

May import the layers below it (``_planning``, ``_frontend``, ``_dist``, ``schedules``, ``_C``),
never ``_runtime`` (docs/architecture.md).
"""
