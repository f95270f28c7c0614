"""Plans that follow the batch: each training call runs the plan of its own shape's group.

``shapes.py`` is the grid calls are grouped on and the shapes and ranges a user plans ahead; ``family.py``
plans each group (memory from a meta replay at the group's shape, times scaled from the example's profile);
``switch.py`` hands the executor each training call's group plan.
"""
