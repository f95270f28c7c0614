"""Stage 2, profile: what one training step costs, node by node, as plain data (``record.Profile``).

``api.profile_for`` is the entry point: measured here (``memory_pass.py`` with ``recorder.py``, ``runner.py``,
``timing.py``, ``windows.py``,
``eager.py``, ``memtrack.py`` and ``cores.py``; in pieces where the step does not fit, ``fitting.py`` and
``pieces.py``, within ``headroom.py``), estimated for a device that is not here (``meta.py``, ``estimate.py``,
``devices.py`` and the bundled ``device_specs/``), scaled to another batch shape from a measured one
(``scaling.py``), or read from a file (``record.py``). ``optimizer.py`` measures what the optimizer keeps and
its step allocates; ``measure.py`` measures any module's real peak and step time the same way, and a whole
training loop's. ``record.py`` imports no torch: the memory model and the solver read it.
"""
