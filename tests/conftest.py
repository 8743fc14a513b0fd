"""Shared test setup: hypothesis profiles (select with HYPOTHESIS_PROFILE), one torch thread,
and the `gpu` marker's skip when CUDA is absent."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# The test models are tiny: one intra-op thread is faster than two fighting over 2 cores.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
