"""Small shared types every stage may use (torch-free): byte budgets (``budget.py``) and their formatting
(``units.py``), the one glob meaning of patterns in options (``patterns.py``), and the checked reader of
JSON files ckplan wrote (``checked_json.py``). They import nothing of ckplan but ``planner.errors``.
"""
