"""mkrt.bench helpers that run without a GPU."""

from __future__ import annotations

import contextlib

from mkrt.bench import repeated


def test_repeated_calls_count_times_inside_one_context():
    calls, entered = [], []

    @contextlib.contextmanager
    def backend():
        entered.append(len(calls))      # how many calls had run when the context opened
        yield

    run = repeated(lambda: calls.append(1), 7, backend)
    run()
    run()
    assert len(calls) == 14 and entered == [0, 7]
    plain = repeated(lambda: calls.append(1), 3)
    plain()
    assert len(calls) == 17
