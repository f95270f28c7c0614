"""Stage 3, the memory model (torch-free): where segments may start and end (``regions.py``), the
model of one step's memory and its evaluation for any plan (``simulate.py``), and op-level saves in
its terms (``saves.py``). ``synthetic.py`` builds hand-made profiles for tests and benchmarks.
"""
