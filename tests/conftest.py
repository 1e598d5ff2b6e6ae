import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Two shared cores: keep intra-op threads low so parallel suites stay predictable.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A long hunt for rare counterexamples, not run by CI: HYPOTHESIS_PROFILE=soak pytest tests/...
settings.register_profile("soak", max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator: every random test input comes from here, never from global state."""
    return torch.Generator().manual_seed(0)
