"""The ``"dcp"`` format: one torch.distributed.checkpoint directory per generation.

``storage`` (``DcpStorage``, its row of the format table), ``state`` (names both
ways), ``files`` (file records, checks, consolidation), ``safe`` (the metadata's
restricted unpickling), ``save`` and ``load``. Design notes: docs/checkpoints.md,
"DCP checkpoints".
"""
