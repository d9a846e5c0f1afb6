"""k3.serve: a continuous-batching engine with a hybrid KDA/MLA prefix cache, behind an OpenAI-compatible API."""
from k3.serve.engine import EngineConfig, EngineThread, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.sequence import CacheReport, RequestOutput

__all__ = ["EngineConfig", "EngineThread", "LLMEngine", "SamplingParams", "CacheReport", "RequestOutput"]
