"""An LSTM unrolled over 512 time steps in a Python loop: the long chain checkpointing was invented for.

``ckplan examples/rnn.py --budget 25%``. The loop calls one ``nn.LSTMCell`` per step; torch.fx unrolls it into
a chain of 512 cell calls, and ckplan treats each call as a block (a cut after every step), as it treats the
numbered blocks of a transformer. Groups of about √512 ≈ 23 steps checkpointed by hand (``hand_groups``) is
the textbook placement; ckplan plans at any budget between that and the plain step, in seconds.

``EagerRNN`` is the same network written so that torch.fx cannot trace it (``torch.zeros(x.shape[0], ...)``
in forward): ckplan records it eagerly and runs the plan with module hooks, checkpointing single calls of the
cell by their index in the loop (``cell#7``). ``StateRNN`` keeps only the state from step to step and classifies
the sequence from the last one.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class UnrolledRNN(nn.Module):
    """Embedding -> LSTMCell over ``steps`` time steps -> a linear head per step; ``hand_groups``: groups of
    that many steps each run under ``torch.utils.checkpoint`` (0: none)."""

    def __init__(self, vocab: int = 256, width: int = 256, steps: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.cell = nn.LSTMCell(width, width)
        self.head = nn.Linear(width, vocab)
        self.steps = steps
        self.hand_groups = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = x[:, 0] * 0  # the state, made from the input so that torch.fx can trace it
        c = h
        outs = []
        for t in range(self.steps):
            if self.hand_groups and t % self.hand_groups == 0:
                h, c, *ys = checkpoint(self._group, x, h, c, t, self.hand_groups, use_reentrant=False)
                outs += ys
            elif not self.hand_groups:
                h, c = self.cell(x[:, t], (h, c))
                outs.append(h)
        return self.head(torch.stack(outs, dim=1))

    def _group(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, first: int, size: int):
        ys = []
        for t in range(first, min(first + size, self.steps)):
            h, c = self.cell(x[:, t], (h, c))
            ys.append(h)
        return (h, c, *ys)


class EagerRNN(UnrolledRNN):
    """The same network, not traceable by torch.fx; ``hand_groups = 1`` checkpoints every call of the cell."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = torch.zeros(x.shape[0], x.shape[2])
        c = torch.zeros(x.shape[0], x.shape[2])
        outs = []
        for t in range(self.steps):
            if self.hand_groups:
                h, c = checkpoint(self.cell, x[:, t], (h, c), use_reentrant=False)
            else:
                h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        return self.head(torch.stack(outs, dim=1))


class StateRNN(UnrolledRNN):
    """The same layers, called over ``steps`` time steps in a Python loop that hands on only its state, the head on
    the last step's ``h`` (a classifier over the sequence); not traceable by torch.fx (``torch.zeros`` shaped by
    the batch in forward). ``hand = True`` checkpoints every call of the cell, as one would by hand."""

    def __init__(self, vocab: int = 1000, width: int = 256, steps: int = 512) -> None:
        super().__init__(vocab, width, steps)
        self.hand = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = torch.zeros(ids.shape[0], self.cell.hidden_size)
        c = torch.zeros(ids.shape[0], self.cell.hidden_size)
        for t in range(self.steps):
            if self.hand:
                h, c = checkpoint(self.cell, x[:, t], (h, c), use_reentrant=False)
            else:
                h, c = self.cell(x[:, t], (h, c))
        return self.head(h)


VOCAB, STEPS = 256, 512
torch.manual_seed(0)
model = UnrolledRNN(VOCAB, 256, STEPS)
_tokens = torch.randint(0, VOCAB, (32, STEPS + 1))
inputs = (_tokens[:, :-1],)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), _tokens[:, 1:].reshape(-1))
