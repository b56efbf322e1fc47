"""The serving engine: ``Engine`` (API), its scheduler, the accelerator verbs, sampling."""
from ftjax.engine.api import (DEFAULT_MAX_LEN, FINISH_REASONS, EngineConfig, EngineError, InvalidRequestError,
                              QueueFullError, Request, RequestResult, StreamEvent)
from ftjax.engine.engine import Engine
from ftjax.engine.handle import RequestHandle
from ftjax.engine.sampling import SamplingParams

__all__ = ["DEFAULT_MAX_LEN", "FINISH_REASONS", "Engine", "EngineConfig", "EngineError", "InvalidRequestError",
           "QueueFullError", "Request", "RequestHandle", "RequestResult", "SamplingParams", "StreamEvent"]
