"""A pytest plugin that runs every LLMEngine with EngineConfig.async_output off (the synchronous step: plan,
launch, read back, finish): `python -m pytest -p sync_output_plugin tests/test_serve_engine.py ...` checks the
serving equalities through the path `--no-async-output` selects. Async output is the default, so the plain run
covers it. test_serve_async_output builds its async engines on purpose: under this plugin it fails by
construction."""
from k3.serve import engine

_init = engine.LLMEngine.__init__


def _sync_init(self, model, tokenizer=None, config=None, metrics=None):
    config = config or engine.EngineConfig()
    config.async_output = False
    _init(self, model, tokenizer, config, metrics)


engine.LLMEngine.__init__ = _sync_init
