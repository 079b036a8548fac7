"""Imported first by every child script: joins the 2-process jax.distributed group the test launched.

Sets 4 CPU devices per process and gloo collectives before jax is imported,
then `jax.distributed.initialize` from the environment the fixture set.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
PROCESS_ID = int(os.environ["VARSTATE_TEST_PROCESS_ID"])
NUM_PROCESSES = int(os.environ["VARSTATE_TEST_NUM_PROCESSES"])
jax.distributed.initialize(
    coordinator_address=os.environ["VARSTATE_TEST_COORDINATOR"],
    num_processes=NUM_PROCESSES,
    process_id=PROCESS_ID,
    heartbeat_timeout_seconds=int(os.environ.get("VARSTATE_TEST_HEARTBEAT_S", "100")),
)
WORKDIR = os.environ["VARSTATE_TEST_WORKDIR"]


def report(name: str, value) -> None:
    """A result for the test to read: one line `RESULT <name> <json>` on stdout."""
    import json

    print(f"RESULT {name} {json.dumps(value)}", flush=True)


def args() -> list[str]:
    return sys.argv[1:]
