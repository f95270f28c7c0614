"""The training loop a plan is for, as plain data: what the loop keeps alive besides the step's own tensors.

A budget is a promise about the step the user runs, and the loop decides part of its peak: gradients of earlier
micro-steps alive through the next forward and backward (gradient accumulation, ``zero_grad(set_to_none=False)``),
gradients of the last step alive through the forward (Lightning zeroes them right before backward), the
optimizer's state, and the optimizer's own step. ``TrainingLoop`` describes those, ``PlanOptions.loop`` builds it
from the options, and the memory model counts each item (``planner.memory.offset``). Torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

from planner.common.checked_json import check_record, record_from_json
from planner.common.units import format_bytes


class ZeroGrad(enum.Enum):
    """Where the loop clears the gradients of the last optimizer step."""

    BEFORE_FORWARD = "before_forward"
    """After ``optimizer.step()`` or before the next forward: plain loops, Trainer, TRL, accelerate."""
    BEFORE_BACKWARD = "before_backward"
    """Right before ``backward()``: Lightning's automatic optimization (the last step's gradients are alive
    through the next forward)."""


class Gradients(enum.Enum):
    """Which earlier gradients are alive during a training step's forward and backward."""

    NONE = "none"
    """Each step starts without gradients."""
    IN_FORWARD = "in_forward"
    """Alive through forward, cleared (set to None) before backward."""
    THROUGHOUT = "throughout"
    """Alive through forward and backward, which accumulates into them in place."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerState:
    """What the optimizer keeps and what its step allocates, for one rank."""

    kind: str
    """The optimizer's name as the summary shows it (``AdamW``, ``SGD``, ``optimizer``)."""
    state_bytes: int
    """Bytes of state it keeps between steps (AdamW: two tensors per trainable parameter)."""
    step_bytes: int = 0
    """Bytes its ``step()`` allocates beyond its state while it runs (foreach temporaries), 0 where unknown."""
    description: str = ""
    """How the state is made up, for the summary (``2 x fp32 parameters``)."""

    def counted(self) -> str:
        what = f" ({self.description})" if self.description else ""
        step = f", {format_bytes(self.step_bytes)} more during its step" if self.step_bytes else ""
        return f"{self.kind} state {format_bytes(self.state_bytes)}{what}{step}"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingLoop:
    """The loop around the step, as far as memory is concerned."""

    keep_output: bool = True
    """Whether the model's output stays referenced through backward (a plain loop) or is dropped first (Trainer)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step; from the second on, the earlier ones' gradients are alive throughout."""
    batches_held: int = 1
    """Micro-batches alive on the device at once (Trainer holds an optimizer step's ``gradient_accumulation_steps``
    batches together); the profiled step counts one."""
    zero_grad: ZeroGrad = ZeroGrad.BEFORE_FORWARD
    """Where the loop clears the last step's gradients."""
    set_to_none: bool = True
    """``zero_grad(set_to_none=...)``: False keeps zero-filled gradients alive throughout every step."""
    autocast: str | None = None
    """The dtype of the ``torch.autocast`` the step runs under (``bfloat16``), None for none."""
    optimizer: OptimizerState | None = None
    """The optimizer's state and step, None where not counted."""

    @property
    def autocast_dtype(self) -> Any:
        """``autocast`` as the torch dtype (None for none); torch is imported only when there is one."""
        if self.autocast is None:
            return None
        import torch

        return getattr(torch, self.autocast)

    @property
    def gradients(self) -> Gradients:
        """Which earlier gradients the step holds: throughout when micro-steps accumulate or zeroing keeps them,
        through the forward only when they are set to None right before backward."""
        if self.gradient_accumulation_steps > 1 or not self.set_to_none:
            return Gradients.THROUGHOUT
        if self.zero_grad is ZeroGrad.BEFORE_BACKWARD:
            return Gradients.IN_FORWARD
        return Gradients.NONE

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``from_dict`` reads it back): plain values, the enums by value."""
        return {"keep_output": self.keep_output, "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "batches_held": self.batches_held,
                "zero_grad": self.zero_grad.value, "set_to_none": self.set_to_none, "autocast": self.autocast,
                "optimizer": None if self.optimizer is None else asdict(self.optimizer)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "loop") -> TrainingLoop:
        """The loop ``to_dict`` wrote.

        Raises:
            TypeError, ValueError, KeyError: a malformed field (named by ``where``).
        """
        raw = dict(data)
        optimizer = raw.pop("optimizer", None)
        loop = record_from_json(cls, {**raw, "zero_grad": ZeroGrad(raw.get("zero_grad", ZeroGrad.BEFORE_FORWARD.value)),
                                      "optimizer": None if optimizer is None else record_from_json(
                                          OptimizerState, optimizer, f"{where}.optimizer")}, where)
        check_record(loop, where=where)
        return loop

    def counted(self) -> tuple[str, ...]:
        """What the budget counts besides the step itself, one phrase each, for the summary."""
        out = []
        if self.optimizer is not None:
            out.append(self.optimizer.counted())
        if self.gradients is Gradients.THROUGHOUT:
            why = (f"{self.gradient_accumulation_steps} micro-steps" if self.gradient_accumulation_steps > 1
                   else "zero_grad(set_to_none=False)")
            out.append(f"gradients alive in forward and backward ({why})")
        elif self.gradients is Gradients.IN_FORWARD:
            out.append("gradients alive in forward (zeroed right before backward)")
        if self.batches_held > 1:
            out.append(f"{self.batches_held} micro-batches held at once")
        if self.autocast is not None:
            out.append(f"autocast to {self.autocast}")
        out.append("output kept through backward" if self.keep_output else "output dropped before backward")
        return tuple(out)
