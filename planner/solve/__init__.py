"""Stage 4, solve (torch-free): which segments to checkpoint, and which ops inside them to keep.

``registry.py`` lists every strategy with one signature and one result type; ``cpsat.py`` is the
default (the exact chunk DP of ``rotor*.py`` first, then OR-Tools CP-SAT with ``cpsat_saves.py``),
``baselines.py`` the hand-made placements, ``peaks.py`` the smallest-peak questions.
"""
