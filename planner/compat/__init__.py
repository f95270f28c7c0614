"""What ckplan needs of torch beyond its public API, in one place (``torch_private.py``).

torch's private names move between releases (torch 2.14 made ``autograd.Function.apply`` a C builtin).
Every private torch entry point the package calls is wrapped there, with keyword arguments where torch takes
them and a check that fails with one line naming the torch version and what is missing; nothing else in
``planner/`` imports a private torch name (``tests/test_torch_private.py`` holds that line).
"""
