"""The suite's last check: every engine process it started is gone once its engines are closed."""

from __future__ import annotations

import engines


def test_no_engine_process_is_left(suite):
    suite.close()
    assert engines.REGISTRY, "the suite started no engine"
    assert engines.leftover_processes() == {}
