"""Stage 1, capture: the user's module as a graph, each node tagged with the module calls around it.

``api.capture`` tries the tiers in order: ``fx.py`` (``torch.fx.symbolic_trace``), ``export.py``
(``torch.export``, non-strict, for Hugging Face models), then fx with the blocks kept as calls.
``inputs.py`` normalises the example inputs; ``scope.py`` reads the per-node module scopes.
"""
