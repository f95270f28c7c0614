"""Planning from inside the training stacks people run, in each stack's own idiom.

One object per stack reads what the stack already knows (the optimizer, mixed precision, gradient accumulation,
whether the model's output outlives the loss, where gradients are zeroed) and plans the model in place at the
start of training, from the first batch of the training loader: ``trainer.PlanCallback`` for Hugging Face's
``Trainer`` and TRL, ``lightning.PlanCallback`` for Lightning, ``accelerate.plan_with`` for accelerate loops.
Nothing imports this package; each module imports its stack only when used.
"""
