"""What an ATen op does to memory, read from its schema and tags: whether it writes fresh memory, whether it
draws random numbers, and the name a plan keys it by.

Capture (which nodes a segment can keep), profiling (which ops of a node a plan can keep, ``NodeCost.kernels``)
and the rewriter (selective checkpointing's policy) must answer these the same way, so they live here.
"""

from __future__ import annotations

import torch


def is_random(op) -> bool:
    """An ATen op that draws random numbers."""
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def writes_new_memory(op) -> bool:
    """An ATen op whose outputs are fresh tensors (not views of, nor in-place writes to, its inputs)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def draws_random(op, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether this call of ``op`` draws random numbers: a random op (``is_random``), unless its ``dropout_p``
    argument is 0 (attention without dropout is deterministic, though its ATen ops are tagged random)."""
    if not is_random(op):
        return False
    schema = getattr(op, "_schema", None)
    for i, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == "dropout_p":
            value = args[i] if i < len(args) else (kwargs or {}).get("dropout_p", argument.default_value)
            return value != 0
    return True


ATTENTION = "aten.scaled_dot_product_attention"
"""The one name every fused attention kernel is counted by (``kernel_name``)."""


def kernel_name(op) -> str:
    """The name an op is counted by in a plan's selective saves (``aten.mm.default``). Attention kernels differ by
    device (``_scaled_dot_product_flash_attention_for_cpu``, ``_scaled_dot_product_efficient_attention``...) and
    a plan made on one device runs on another: every one is named ``ATTENTION``."""
    name = str(op)
    return ATTENTION if name.startswith("aten._scaled_dot_product_") else name
