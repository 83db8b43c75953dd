"""How long vLLM's queue readers spin (faircast_ds/vllm/spin.py, ``FAIRCAST_VLLM_SPIN_S``), against vLLM's own
``SpinCondition``: a reader made after install spins the environment's seconds (0: sleeps at once on the
notification), a writer is untouched, unset leaves vLLM's default, a bad value names the variable."""
from __future__ import annotations

import pytest

from faircast_ds.vllm import spin

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast",
                                    reason="setup installs vLLM (launch/setup.d)")


@pytest.fixture
def condition(monkeypatch):
    """vLLM's SpinCondition, its __init__ restored after the test; a reader on a fresh zmq context."""
    import zmq

    cls = shm_broadcast.SpinCondition
    monkeypatch.setattr(cls, "__init__", cls.__init__)
    context = zmq.Context()
    made = []

    def make(is_reader: bool):
        address = shm_broadcast.get_open_zmq_ipc_path()
        c = cls(is_reader=is_reader, context=context, notify_address=address)
        made.append(c)
        return c

    yield make
    for c in made:
        for sock in ("local_notify_socket", "read_cancel_socket", "write_cancel_socket"):
            s = getattr(c, sock, None)
            if s is not None:
                s.close(linger=0)
    context.term()


@pytest.mark.parametrize("value, want", [(None, None), ("", None), ("0", 0.0), ("0.005", 0.005), (" 2 ", 2.0)])
def test_the_seconds_are_read_from_the_environment(value, want):
    assert spin.chosen({} if value is None else {spin.ENV: value}) == want


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_value_names_the_variable(value):
    with pytest.raises(ValueError, match=rf"FAIRCAST_VLLM_SPIN_S='{value}': a number of seconds >= 0"):
        spin.install({spin.ENV: value})


def test_unset_leaves_vllms_readers_alone(condition):
    assert spin.install({}) is None
    assert condition(True).busy_loop_s == 1  # vLLM's own default


def test_readers_made_after_install_spin_the_given_seconds(condition):
    assert spin.install({spin.ENV: "0"}) == 0.0
    assert condition(True).busy_loop_s == 0.0
    assert condition(False).busy_loop_s == 0  # a writer never spins either way
    assert spin.install({spin.ENV: "0.25"}) == 0.25  # installed again: the new value, not wrapped twice
    assert condition(True).busy_loop_s == 0.25
