"""The applications: what a person runs, around the engines of the steps.

Every step's ``run.py`` calls ``main.py``, which routes the command line to a front end: the
chapter's demo (``demo.py``), or with ``--model DIR`` text in and out of a real checkpoint
(``text_cli.py``, over ``text.py``'s Python API, ``codec.py`` and ``stream.py``), or with
``--chat`` a conversation (``chat_loop.py``). Every step's ``serve.py`` calls ``serve/``, the
OpenAI-compatible server. Beside them: one way to build an engine (``build.py``), the typed
engine options (``options.py``: ``EngineOptions``, checked once), the flags every command shares
(``cli.py``), how a command ends (``exits.py``), the trace of the block pool and its picture
(``trace.py``, ``trace_plot.py``), the step registry (``steps.py``: ``STEPS``, ``FIXES``,
``STEP_OPTIONS``, the engine options only later steps take, ``load_step``), Hugging Face's
model on the same weights (``hf.py``) and the prompt sets (``workload.py``).

Imports run one way: an application imports steps (by name, through ``steps.load_step``) and
the core, ``common/``; no step's engine and no core module imports an application.
"""
