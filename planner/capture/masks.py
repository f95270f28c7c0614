"""Hugging Face's attention masks under ``torch.export`` as eager code makes them.

A model on the meta device is captured with ``torch.export`` (``planner.capture.export``), and Hugging Face's mask
code takes another path when it detects export: it cannot read tensor values, so it cannot see that the positions
the model makes itself hold one sequence per row (``find_packed_sequence_indices``), nor skip the causal mask
(``_ignore_causal_mask_sdpa``). It then materialises a ``batch x 1 x tokens x tokens`` boolean mask and hands it to
every attention call, where SDPA makes an additive copy in the query's dtype and keeps it for backward. Eager code on
a GPU passes no mask and lets the causal kernel mask, which also lets grouped key/value heads through unrepeated
(``use_gqa_in_sdpa``). At 32k tokens that is 1 GiB for the mask and 3 GiB per attention call a GPU never allocates.

``eager_masks`` makes the two decisions as eager code makes them for an example that passes no ``attention_mask``,
no ``position_ids`` and no cache: one unpadded sequence per row, which eager code finds by reading the positions.
Any other example keeps the export path (its mask may hold padding only its values show).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

DECIDED_BY_VALUES = ("attention_mask", "position_ids", "past_key_values", "cache_position")
"""Inputs whose values decide Hugging Face's mask: an example passing any of them keeps the export path."""


@contextlib.contextmanager
def eager_masks(kwargs: dict) -> Iterator[None]:
    """Within the block, Hugging Face's mask code (if loaded) decides as eager code does for ``kwargs``
    (an example without ``DECIDED_BY_VALUES``)."""
    masking: Any = sys.modules.get("transformers.masking_utils")
    ignore = getattr(masking, "_ignore_causal_mask_sdpa", None)
    packed = getattr(masking, "find_packed_sequence_indices", None)
    if ignore is None or packed is None or any(kwargs.get(name) is not None for name in DECIDED_BY_VALUES):
        yield
        return
    signature = inspect.signature(ignore)

    def causal_kernel_masks(*args: Any, **kw: Any) -> bool:
        """True (no mask: SDPA's causal kernel) where eager code finds no padding and a square causal mask."""
        try:
            bound = signature.bind(*args, **kw).arguments
        except TypeError:
            return ignore(*args, **kw)
        q_length, kv_length = bound.get("q_length"), bound.get("kv_length")
        local = bound.get("local_attention_size")
        if (bound.get("padding_mask") is None and q_length is not None and (q_length == 1 or q_length == kv_length)
                and (local is None or kv_length < local)):
            return True
        return ignore(*args, **kw)

    masking._ignore_causal_mask_sdpa = causal_kernel_masks
    masking.find_packed_sequence_indices = lambda position_ids: None  # positions the model made: one sequence
    try:
        yield
    finally:
        masking._ignore_causal_mask_sdpa = ignore
        masking.find_packed_sequence_indices = packed
