"""A pytest plugin that runs every LLMEngine with EngineConfig.async_output on: `python -m pytest -p
async_output_plugin tests/test_serve_engine.py ...` checks the existing serving equalities through the async
path. Tests that count host reads per step or replace `ModelRunner.run` with a three-argument function assume
the synchronous step and fail under it by construction."""
from k3.serve import engine

_init = engine.LLMEngine.__init__


def _async_init(self, model, tokenizer=None, config=None, metrics=None):
    config = config or engine.EngineConfig()
    config.async_output = True
    _init(self, model, tokenizer, config, metrics)


engine.LLMEngine.__init__ = _async_init
