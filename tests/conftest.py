"""Shared pytest fixtures. Each helper owns the fixtures under its prefix (model_, tokenizer_, ...)."""

from __future__ import annotations

import pytest

from kvroute.model_source import ModelSource, resolve_model
from kvroute.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def model_smollm2_source() -> ModelSource:
    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def tokenizer_smollm2(model_smollm2_source: ModelSource) -> Tokenizer:
    return Tokenizer.from_gguf(model_smollm2_source.path)


@pytest.fixture
def redis_server():
    """A real redis-server on a free port (launch/redis_server.py); `.stop()`, `.start()`, `.restart()`, `.url`."""
    from launch.redis_server import RedisServer

    with RedisServer() as server:
        yield server
