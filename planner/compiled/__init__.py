"""The compiled path: a byte budget for ``torch.compile``'s own recomputation.

Under ``torch.compile`` AOTAutograd's partitioner decides, op by op over the joint graph, what is
saved and what backward re-runs, and inductor fuses what it re-runs into backward kernels; that
beats compiling an eager plan (bench/results/compiled_gpt.md). Its only knob,
``activation_memory_budget``, is a fraction of the saved bytes, not a peak, and the peak it gives is
not monotonic in it. ``optimize_compiled`` (api.py) turns a byte budget into the fastest partition
whose *measured* peak fits: backend.py compiles the model at a fraction with a dynamo cache of its
own, search.py measures each probe's peak (allocator events) and times the ones that fit.
"""
