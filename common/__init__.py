"""What every step is built on, the same in all of them: the core.

``config.py`` (ModelConfig, presets), ``weights.py`` (seeded weights), ``layers.py`` (the Llama
layers), ``checkpoint.py`` (a local Hugging Face checkpoint), ``errors.py``, ``hashing.py`` (the
block hash), ``inputs.py`` (the request checks), ``stats.py`` (EngineStats), ``kv_events.py``,
and ``reference.py``: the dense reference model, the oracle every step is checked against.

The front ends that run the steps (the demo, text, the trace, the step registry, ...) live in
``common/front/``; nothing here imports them.
"""
