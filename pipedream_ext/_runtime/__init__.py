"""Running a built pipeline: configuration, the stage call, runners,
``forward_only``'s outputs, tied gradients, gradient clipping, loss scaling, the step's loss and
observation (stats, Chrome trace).

May import the layers below it (``_parallel``, ``_planning``, ``_frontend``, ``_dist``, ``schedules``, ``_C``)
(docs/architecture.md).
"""
