"""Shared fixtures: a tiny hybrid model whose caches are a few KiB, so views can be checked byte by byte."""

from __future__ import annotations

import copy

import netns
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``netns`` run only inside their namespace, their wrappers only outside (tests/netns.py)."""
    netns.deselect(config, items)


@pytest.fixture
def netns_run(request: pytest.FixtureRequest):
    """Runs the requesting file's ``netns`` tests in a network namespace of their own (tests/netns.py)."""
    return netns.runner(request)
