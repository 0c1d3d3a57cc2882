"""Hypothesis profiles of the property-based parity suite: ``ci`` (default) and ``long``.

Chosen by ``HYPOTHESIS_PROFILE`` in the environment of pytest (read in the parent; the rank
processes get the choice as arguments). Both run only the explicit and generate phases, with
no example database: every rank of a gloo group must draw the same examples and issue the
same collectives, so nothing may depend on a rank's history, and shrinking (which replays
examples under a time budget) is off. ``ci`` is derandomized (a fixed seed: the same
examples on every run; the parity suite seeds each world size apart, ``CI_SEED``) with a
fixed example count per world size, sized to the main suite's budget (issue 59); ``long``
draws many more, from ``FSDP2_PROPERTY_SEED`` (a random seed if unset, printed by the test so
that a failure can be replayed).

Profiles are registered here, not loaded: ``settings.load_profile`` would change the
defaults of every other hypothesis test in the session.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

PROFILE_ENV = "HYPOTHESIS_PROFILE"
# The parity suite's ``ci`` seed is ``CI_SEED + world size`` (fixed; a seed overrides
# ``derandomize``): with derandomize's one seed, every world size drew the same choices.
CI_SEED = 5900
SEED_ENV = "FSDP2_PROPERTY_SEED"

# Examples per world size; ws 4 on 2 shared cores costs most per example. ``ci`` is sized to
# the main suite's budget (issue 59: about 20 s for the parity suite on 2 cores): every world
# size still runs, each over the whole strategy (any spec can be drawn on any world size),
# with the fewest examples on ws 4, which costs about 5 times what ws 1 does per example.
EXAMPLES: dict[str, dict[int, int]] = {
    "ci": {1: 50, 2: 60, 3: 40, 4: 30},
    "long": {1: 1000, 2: 1500, 3: 1000, 4: 1000},
}

# The call-order suite (test_call_order_property.py): state-machine runs per world size, and rules
# per run. ``ci``: about 35 s for all world sizes on 2 cores (issue 59); 20 rules a run still
# reach every rule and the multi-step sequences (forward, optimizer built, backward, step).
ORDER_RUNS: dict[str, dict[int, int]] = {
    "ci": {1: 10, 2: 12, 3: 6, 4: 6},
    "long": {1: 300, 2: 400, 3: 100, 4: 100},
}
ORDER_STEPS = {"ci": 20, "long": 50}

_COMMON = {
    "deadline": None,
    "database": None,
    "phases": [Phase.explicit, Phase.generate],
    "suppress_health_check": list(HealthCheck),
    "print_blob": False,
}
settings.register_profile("ci", derandomize=True, **_COMMON)  # type: ignore[arg-type]
settings.register_profile("long", derandomize=False, **_COMMON)  # type: ignore[arg-type]


def profile_name() -> str:
    name = os.environ.get(PROFILE_ENV, "ci")
    if name not in EXAMPLES:
        raise ValueError(f"{PROFILE_ENV}={name!r}: the property suite knows {sorted(EXAMPLES)}")
    return name


def profile(name: str, max_examples: int) -> settings:
    return settings(settings.get_profile(name), max_examples=max_examples)
