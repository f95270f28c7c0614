"""Plans that follow the batch: each training call runs the plan of its own shape's group.

``shapes.py`` is the grid calls are grouped on and the shapes and ranges a user plans ahead; ``family.py``
chooses each training call's group and plans a new one through ``planner.planning.step`` (memory from a meta
replay at the group's shape, times scaled from the example's profile: ``planner.profiling.scaling``);
``groups.py`` holds the groups' plans, their table and their JSON. ``planner.rewrite.switching`` hands the
executor each training call's group plan.
"""
