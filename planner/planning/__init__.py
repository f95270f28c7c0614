"""The solve stage as ``plan_for`` runs it on a model: ``prepared.py`` holds a model captured and profiled once
(``Prepared``) with its cost model at one chunking; ``chunkings.py`` finds the plan for a byte budget at that
chunking or finer ones, under one ``Deadline``. The strategies themselves are ``planner.solve`` (torch-free).
"""
