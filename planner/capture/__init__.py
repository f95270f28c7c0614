"""Stage 1, capture: the user's module as a graph, each node tagged with the module calls around it.

``api.capture`` tries the tiers in order: ``fx.py`` (``torch.fx.symbolic_trace``), ``export.py``
(``torch.export``, non-strict, for Hugging Face models), then fx with the blocks kept as calls.
``aten.py`` captures the ATen ops of one eager forward run by module hooks (models fx cannot trace).
``inputs.py`` normalises the example inputs; ``calls.py`` indexes the module calls from the per-node scopes;
``setting.py`` is the setting every step is captured and profiled in (``cache.py``, ``frameworks.py``,
``step.py``); ``tree.py`` copies the module tree ckplan changes.
"""
