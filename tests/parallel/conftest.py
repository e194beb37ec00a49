"""Fixtures for the distributed tests: persistent gloo worlds (see _world.py)."""

import os
import sys

import pytest

# The helpers beside this file (_world, _tp_models) import by name; pytest's importlib mode does not
# put test folders on sys.path, and the worker processes find them the same way (_world.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _world import World  # noqa: E402


@pytest.fixture(scope="session")
def worlds():
    """worlds(size) -> a live World of that size, restarted if a previous test broke it."""
    pool: dict[int, World] = {}

    def get(size: int) -> World:
        current = pool.get(size)
        if current is None or current.broken:
            if current is not None:
                current.close()
            current = pool[size] = World(size)
        return current

    yield get
    for w in pool.values():
        w.close()


@pytest.fixture
def world(worlds) -> World:
    return worlds(2)
