"""Shared fixtures: a tiny hybrid model whose caches are a few KiB, so views can be checked byte by byte."""

from __future__ import annotations

import copy

import pytest
from tiny_model import TINY_CONFIG

from hybrid_transfer.layout import ModelSpec, model_from_config


@pytest.fixture
def tiny_config() -> dict:
    """A fresh, mutable copy of the tiny flat config."""
    return copy.deepcopy(TINY_CONFIG)


@pytest.fixture(scope="session")
def tiny_model() -> ModelSpec:
    return model_from_config(TINY_CONFIG, name="tiny")
