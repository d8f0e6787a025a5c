"""The user's model -> stages: tracing (torch.fx, torch.export), partitions, this rank's
stages (``LocalStages``), model inputs and outputs, deferred initialisation, tied parameters.

Imports only ``_dist`` (fingerprints) and ``_C`` below it; runs before any
communication (docs/architecture.md).
"""
