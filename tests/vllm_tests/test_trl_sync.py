"""``install_trl_sync``'s refusals, in process: each names the setting at fault. What it does on a real run (TRL,
vLLM, two DeepSpeed ranks, the bits read back) is tests/transformers_tests/test_trl_colocate.py's."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from faircast_ds.vllm import TrlReloadSync, install_trl_sync


def generation(**overrides):
    """What install_trl_sync reads of TRL's VLLMGeneration before it touches the engine."""
    fields = dict(mode="colocate", enable_sleep_mode=False)
    fields.update(overrides)
    gen = SimpleNamespace(**fields)
    gen.sync_weights = lambda: None
    return gen


def test_a_trainer_without_vllm_is_refused():
    with pytest.raises(ValueError, match="use_vllm=True"):
        install_trl_sync(SimpleNamespace())


def test_server_mode_is_refused():
    with pytest.raises(ValueError, match="vllm_mode='colocate', not 'server'"):
        install_trl_sync(SimpleNamespace(vllm_generation=generation(mode="server")))


@pytest.mark.parametrize("load", ["load_weights", "", None])
def test_an_unknown_load_is_refused(load):
    with pytest.raises(ValueError, match="load must be one of 'reload', 'trl'"):
        TrlReloadSync(generation(), load=load)


@pytest.mark.parametrize("verify", [-1, 1.5, "always"])
def test_a_bad_verify_is_refused(verify):
    with pytest.raises(ValueError, match="verify must be True, False or a whole number"):
        TrlReloadSync(generation(), verify=verify)


def test_sleep_mode_is_refused():
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=True is not supported"):
        TrlReloadSync(generation(enable_sleep_mode=True))


def test_install_replaces_the_method_once_and_keeps_trls():
    gen = generation()
    own = gen.sync_weights
    trainer = SimpleNamespace(vllm_generation=gen)
    sync = install_trl_sync(trainer, verify=3)
    assert gen.sync_weights == sync.sync and sync.trl_sync is own and sync.every == 3
    with pytest.raises(ValueError, match="already called on this trainer"):
        install_trl_sync(trainer)
