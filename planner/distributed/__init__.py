"""Planning for one rank of a data-parallel job (FSDP2 or DDP), or every stage of a pipeline.

``memory.py`` is the per-rank memory model ``optimize`` uses; ``rank.py`` is what each rank of a
``torch.distributed`` job does with a plan (``plan_on_rank0``, ``fully_shard_units``...), imported
only when asked for: ``from planner.distributed import plan_on_rank0``; ``stages.py`` plans every stage of a model
split for pipeline parallelism (``plan_stages``).
"""


_RANK_HELPERS = ("plan_on_rank0", "apply_plan", "fully_shard_units", "count_collectives", "rank_peak_bytes",
                 "resident_bytes", "same_on_all_ranks")


def __getattr__(name: str):
    if name in _RANK_HELPERS:
        from planner.distributed import rank

        return getattr(rank, name)
    if name == "plan_stages":
        from planner.distributed.stages import plan_stages

        return plan_stages
    raise AttributeError(f"module 'planner.distributed' has no attribute {name!r}")
