"""A process that dies while another waits at a barrier is named by varstate before jax's heartbeat ends the group."""

import re

HEARTBEAT_S = 12  # jax.distributed.initialize(heartbeat_timeout_seconds=...): then jax aborts the survivors
PEER_TIMEOUT_S = 3


def test_a_dead_process_is_named_before_jaxs_heartbeat_aborts_the_survivor(group):
    out = group("child_die_at_barrier.py", all_succeed=False,
                env={"VARSTATE_TEST_HEARTBEAT_S": str(HEARTBEAT_S), "VARSTATE_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S),
                     "VARSTATE_BARRIER_TIMEOUT_S": "60"})
    # Exit 0, not -6: process 0 reported and left before jax's coordination service declared process 1 dead.
    assert [o.returncode for o in out] == [0, 17], "\n".join(map(str, out))
    assert "Terminating process" not in out[0].output
    kind, message, waited = out[0].results["barrier"]
    assert kind == "ProcessGroupError", message
    assert re.fullmatch(
        r"Process 0 of 2: process 1 did not reach the barrier 'varstate-test#1': it died or exited \(no pulse for 3 s, "
        r"VARSTATE_PEER_TIMEOUT_S\)\. The save was abandoned: the checkpoint being written is not published and the "
        r"latest checkpoint is unchanged\. Every process must call each save and restore; check the log of process 1, "
        r"then restart the job\.", message), message
    assert PEER_TIMEOUT_S <= waited < HEARTBEAT_S - 3, waited


def test_the_message_names_which_of_the_missing_died(monkeypatch):
    from checkpoint._storage import _distributed

    monkeypatch.setattr(_distributed, "PEER_TIMEOUT_S", 30.0)
    error = _distributed._missing("varstate-written:/ckpt#2", 600, missing=[1, 2], dead=[2])
    assert str(error).startswith(
        "Process 0 of 1: process 1, process 2 did not reach the barrier 'varstate-written:/ckpt#2': process 2 died or "
        "exited (no pulse for 30 s, VARSTATE_PEER_TIMEOUT_S).")
    assert "check the log of process 2, then restart the job." in str(error)
