"""Shared configuration for the Python test suite.

Hypothesis runs derandomized (the same examples on every run and every machine) with no
example database, so a failure reproduces from the test name alone. Set
``KVCOMPASS_HYPOTHESIS_PROFILE=thorough`` to search much harder locally.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import kvcompass as kc

settings.register_profile(
    "kvcompass",
    deadline=None,
    derandomize=True,
    database=None,
    max_examples=40,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("kvcompass"), max_examples=1000)
settings.load_profile(os.environ.get("KVCOMPASS_HYPOTHESIS_PROFILE", "kvcompass"))


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, fixed-seed generator per test (tests never share random state)."""
    return np.random.default_rng(20240611)


@pytest.fixture(scope="session")
def namespace() -> kc.Namespace:
    return kc.Namespace("llama-3.1-8b", "public")


@pytest.fixture(scope="session")
def ns_digest(namespace: kc.Namespace) -> bytes:
    return namespace.digest
