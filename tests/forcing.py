"""Plans that force saves, for tests and benchmarks that compare them with what the solver chooses."""

import dataclasses

from planner.memory.candidates import save_options
from planner.memory.saves import partner, segment_of
from planner.memory.simulate import simulate


def every_save(profile, memory, plan, savable) -> frozenset:
    """Every save the segments of ``plan`` (chunk ranges) allow, SAC's charge aside: each candidate
    whose ``partner`` shares its segment, in node order, kept when the memory model accepts it next to
    the ones before. For tests and benchmarks that force saves (the solver weighs their cost)."""
    seg = segment_of(memory, plan)
    free = dataclasses.replace(memory, sac_chunk_us=memory.sac_chunk_us * 0)  # every candidate, paying or not
    saves: frozenset = frozenset()
    for o in save_options(profile, free, savable=savable).candidates:
        if seg[o] >= 0 and seg[partner(memory, o)] == seg[o]:
            try:
                simulate(memory, plan, saves | {o})
            except ValueError:  # a later segment reads a storage only SAC's cache would hold
                continue
            saves |= {o}
    return saves
