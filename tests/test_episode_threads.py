"""The episodes' daemon pools: a call past its timeout is replaced by a new thread, and the pool
never grows past twice its size however many calls hang."""

from __future__ import annotations

import logging
import threading

import pytest

from engine_core_roles.episodes.threads import _Daemons


def test_hung_calls_are_replaced_up_to_twice_the_pool(caplog: pytest.LogCaptureFixture) -> None:
    pool = _Daemons(2)
    gate = threading.Event()
    try:
        hung = [pool.submit(gate.wait) for _ in range(2)]  # both threads held
        pool.abandoned()
        pool.abandoned()
        assert pool.submit(lambda: 7).result(timeout=10) == 7  # the replacements serve
        hung += [pool.submit(gate.wait) for _ in range(2)]  # and now hang too
        with caplog.at_level(logging.WARNING, logger="engine_core_roles.episodes.threads"):
            for _ in range(5):
                pool.abandoned()
        assert pool.threads == 4  # bounded: no thread for the last five
        warnings = [r for r in caplog.records if "env.tool_processes" in r.getMessage()]
        assert len(warnings) == 1 and "3 environment calls" in warnings[0].getMessage()
        late = pool.submit(lambda: 8)
        assert not late.done()  # every thread is held: the call waits
        gate.set()
        assert late.result(timeout=10) == 8
        assert all(f.result(timeout=10) for f in hung)
    finally:
        gate.set()
