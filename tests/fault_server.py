"""`novainfer serve` whose engine core process runs with a fault injected (tests/faults.py): the spec comes
from the NOVAINFER_TEST_FAULT environment variable, read only here."""

import os
import sys

from novainfer.engine import core_client
from novainfer.entrypoints.cli import main

_run_engine_core = core_client._run_engine_core


def _run_engine_core_with_fault(*args: object) -> None:
    """The core process's entry point, the fault installed first (in that process: torch is loaded there)."""
    from tests import faults

    faults.install(os.environ["NOVAINFER_TEST_FAULT"])
    _run_engine_core(*args)


if __name__ == "__main__":
    core_client._run_engine_core = _run_engine_core_with_fault
    sys.exit(main())
