"""Stage 5, rewrite: the module that runs a plan with ``torch.utils.checkpoint``.

``graph.py`` emits a subclass of the user's class from the captured graph; ``sac.py`` runs op-level
saves with torch's selective checkpointing; ``candidates.py`` says which nodes those can save.
"""
