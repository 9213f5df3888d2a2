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


def test_rounds_lead_in_turn_and_vary_what_follows_what():
    from mkrt.bench import round_orders
    names = ["ring", ("ring", "s3"), "floor", "cudnn", "per_step"]
    orders = round_orders(names, 10)
    assert orders == round_orders(names, 10)            # the same in every run
    for k, order in enumerate(orders):
        assert sorted(map(str, order)) == sorted(map(str, names))
        assert order[0] == names[k % len(names)]
    # rotated rounds gave every call one predecessor; shuffled ones give several
    predecessors = {str(n): {str(o[o.index(n) - 1]) for o in orders if o.index(n) > 0}
                    for n in names}
    assert all(len(p) >= 2 for p in predecessors.values()), predecessors
