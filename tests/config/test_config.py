"""The fair_cast section: strict validation with errors that name the key and the accepted values."""
from __future__ import annotations

import pytest

from faircast_ds.config.section import FairCastConfig, FairCastConfigError, find_section


def test_defaults_and_a_full_section():
    assert find_section({"train_batch_size": 8}) is None
    cfg = find_section({"fair_cast": {"enabled": True, "mode": "error_feedback", "seed": 1234}})
    assert (cfg.enabled, cfg.mode, cfg.seed, cfg.on_nonfinite) == (True, "error_feedback", 1234, "error")
    assert FairCastConfig.from_section({}) == FairCastConfig(mode="dither", seed=0)  # the default (docs/modes.md)


@pytest.mark.parametrize("section, words", [
    ({"moed": "dither"}, ["fair_cast.moed", "unknown key", "did you mean 'mode'", "accepted keys: enabled, mode"]),
    ({"mode": "sr"}, ["fair_cast.mode", "'sr'", "nearest, stochastic, dither, error_feedback"]),
    ({"seed": 1.5}, ["fair_cast.seed", "float 1.5", "an integer"]),
    ({"seed": True}, ["fair_cast.seed", "bool True"]),
    ({"seed": -3}, ["fair_cast.seed", "int -3"]),
    ({"enabled": "true"}, ["fair_cast.enabled", "str 'true'", "true or false"]),
    ({"on_nonfinite": "ignore"}, ["fair_cast.on_nonfinite", "one of error, propagate"]),
    (["stochastic"], ["fair_cast: expected an object"]),
])
def test_bad_values_are_named(section, words):
    with pytest.raises(FairCastConfigError) as err:
        FairCastConfig.from_section(section)
    for w in words:
        assert w in str(err.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(FairCastConfigError) as err:
        FairCastConfig.from_section({"mode": "x", "sed": 1})
    assert "fair_cast.mode" in str(err.value) and "fair_cast.sed" in str(err.value)
