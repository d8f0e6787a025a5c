"""The ``"pipedream"`` format: one ``torch.save`` file per stage, sha256-checked.

``storage`` (``StageFilesStorage``, its row of the format table) and ``load`` (this
rank's share, re-sharded by name). Layout: docs/checkpoints.md.
"""
