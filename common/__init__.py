"""What every step is built on, the same in all of them: the core.

``config.py`` (ModelConfig, presets), ``weights.py`` (seeded weights), ``layers.py`` (the Llama
layers), ``checkpoint.py`` (a local Hugging Face checkpoint), ``errors.py``, ``hashing.py`` (the
block hash), ``inputs.py`` (the request checks), ``sampling_params.py`` (what a request asks
for and what a round hands back), ``sampler.py`` (the sampler every step shares), ``stats.py``
(EngineStats), ``kv_events.py``, and ``reference.py``: the dense reference model, the oracle
every step is checked against.

Nothing a person runs lives here: the applications that run the steps (the demo, text, the
chat loop, the server, the trace, the step registry, ...) are in ``front/``, and the bench in
``bench/``; nothing here imports them, prints, or parses a command line.
"""
