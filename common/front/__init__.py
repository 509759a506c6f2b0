"""The front ends: what a person runs, around the engines of the steps.

The chapter's demo (``demo.py``, behind every step's ``run.py``), text in and out of a real
checkpoint (``text.py``, ``chat.py``; ``text_cli.py``, its command line; ``stream.py``, its
answers printed as they grow), the command lines' checks (``cli.py``), the trace of the
block pool and its picture (``trace.py``, ``trace_plot.py``), the step registry (``steps.py``:
``STEPS``, ``FIXES``, ``load_step``), Hugging Face's model on the same weights (``hf.py``) and
the prompt sets (``workload.py``).

Imports run one way: a front end imports steps (by name, through ``steps.load_step``) and the
core of ``common/``; no step's engine and no core module imports a front end.
"""
