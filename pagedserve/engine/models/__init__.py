"""Model classes and their configs.

``registry.py`` is the one list of architectures: each line names the parser of its
``config.json`` (``llama_config.py``, ``gpt_config.py``; configs extend ``config.py``'s
:class:`~pagedserve.engine.models.config.ModelConfig`) and the module of its model class. The configs
and the registry import no torch (the gateway reads them); the model classes (``llama.py``,
``gpt2.py``, ...) derive :class:`~pagedserve.engine.models.sharded.ShardedCausalLM` and provide
``forward``, ``compute_logits`` and ``load_checkpoint``. This package module imports nothing, so
importing a config does not import the models.
"""
