"""Shared settings for the unit tests of the C core.

Hypothesis profiles: ``cfsdp`` (default: moderate example counts, no
deadline, so the unit suite stays well under a minute on 2 cores) and
``sanitize`` (fewer examples; ``make sanitize`` runs the suite under
ASan/UBSan, which is several times slower).  Pick one with
``CFSDP_HYPOTHESIS_PROFILE``.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "cfsdp",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "sanitize",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("CFSDP_HYPOTHESIS_PROFILE", "cfsdp"))
