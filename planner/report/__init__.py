"""The views, which nothing else imports: the ``ckplan`` command (``cli.py``, rendered by
``render.py``), trade-off sweeps for notebooks (``explore.py``) and matplotlib figures (``plotting.py``).
"""
