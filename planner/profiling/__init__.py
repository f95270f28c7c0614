"""Stage 2, profile: what one training step costs, node by node, as plain data (``record.Profile``).

``api.profile`` / ``api.profile_for`` are the entry points: measured here (``memory_pass.py`` with
``runner.py``, ``timing.py``, ``eager.py`` and ``memtrack.py``), estimated for a device that is not
here (``meta.py``, ``estimate.py``, ``devices.py`` and the bundled ``device_specs/``), or read from a
file (``io.py``). ``measure.py`` measures any module's real peak and step time the same way.
``record.py`` and ``io.py`` import no torch: the memory model and the solver read them.
"""
