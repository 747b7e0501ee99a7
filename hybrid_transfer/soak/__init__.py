"""The soak (issue 14): prefill and decode processes on loopback, thousands of requests with faults mixed in.

run.py drives it (``run_soak``), worker.py is one rank process, messages.py what they say to each
other. ``hybrid-transfer soak`` is the command line; docs/soak.md has a full report and its command.
"""

from hybrid_transfer.soak.run import SoakReport, SoakSpec, render, run_soak

__all__ = ["SoakReport", "SoakSpec", "render", "run_soak"]
