"""The SM-partition controller's rule: how many CTAs the reduce (communication) role gets,
decided again at every control step from signals the tasks already produce.

This is the rule in Python, exact and small, so that it can be tested on recorded or
simulated signal traces on any machine; the device controller
(``mkrt::roles::control_step`` in mkrt/kernels/device/roles.py) runs the same arithmetic in
one thread of the persistent kernel at task boundaries: integers, except the two rates and
the balance point, which are IEEE doubles computed in the same order here and there.

Signals per control step (what the running kernel counts without extra work): tiles the
compute role finished, tiles the reduce role finished, the share of the reduce CTAs'
time spent waiting for flags, compute tiles not started, and the backlog of tiles ready to
reduce that no reduce CTA has taken (:class:`Signals`). The rule (:class:`SplitController`)
balances the two roles' measured rates, damped; a role never drops below one CTA while it
has work, and the split a call ends with is remembered per op and shape
(:class:`SplitMemory`), so the next call starts from it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Signals:
    """What the kernel counted during one control step."""

    computed: int              # tiles the compute role finished in the step
    reduced: int               # tiles the reduce role finished in the step
    reduce_wait_permille: int  # share of the reduce CTAs' time spent waiting (0-1000)
    compute_left: int          # compute tiles not started yet
    backlog: int               # tiles ready to reduce that no reduce CTA has taken
    reduce_left: int = 1       # tiles not reduced yet (0: the reduce role is done)
    reduce_ctas: int = 0       # CTAs in the reduce role during the step (0: the split the
                               # rule set; on the GPU CTAs move back only at the next launch)


@dataclasses.dataclass
class SplitController:
    """One call's controller: ``ctas`` in all, ``reduce`` of them in the reduce role.

    Signals are summed over control steps until ``min_tiles`` tiles were computed (a rate
    measured on fewer is noise). Then it estimates the two roles' rates per CTA (tiles
    per step: the compute role's from what it finished, the reduce role's from what it
    finished while not waiting) and aims at the split where they balance,
    ``ctas * c / (c + r)`` reduce CTAs (a backlog left there drains at the end of the
call, when every CTA reduces); before any rate is known, a backlog that is large and
growing adds one reduce CTA; a
    reduce role that waits almost all the time (``idle_permille``) gives half its CTAs
    back at once. Each decision moves half the way to its aim (at least one CTA); a move
    against the previous one is a reversal, and after ``settle`` reversals of one CTA the
    split is frozen. With no compute work left, every CTA may reduce."""

    ctas: int
    reduce: int
    min_tiles: int = 4         # tiles computed before a rate is trusted
    backlog_high: int = 2      # tiles waiting per reduce CTA before it is "behind"
    idle_permille: int = 900   # a reduce role waiting more than this has too many CTAs
    settle: int = 2            # one-CTA reversals before the split is frozen
    min_reduce: int = 1
    compute_total: int = 1     # the roles' whole work in tasks (rates are compared as
    reduce_total: int = 1      # shares of it: 4 compute tiles per reduce tile -> 4:1)
    last_move: int = 0         # +1: towards reduce, -1: towards compute, 0: none yet
    reversals: int = 0
    frozen: bool = False
    moves: int = 0
    steady: int = 0            # the split while compute work remained: what to remember
    last_backlog: int = 0
    behind: bool = False       # the last step found the reduce role behind (backlog large,
                               # growing): on the GPU, the only evidence that moves a CTA
                               # to the reduce role within a launch (one more per step)
    _sum: list = dataclasses.field(default_factory=lambda: [0, 0, 0, 0])   # computed, reduced, wait, steps

    def __post_init__(self):
        if self.ctas < 2:
            raise ValueError(f"mkrt.controller: a split needs at least 2 CTAs, got {self.ctas}")
        if not self.min_reduce <= self.reduce <= self.ctas - 1:
            raise ValueError(f"mkrt.controller: reduce={self.reduce} must be in "
                             f"[{self.min_reduce}, {self.ctas - 1}]")
        self.steady = self.reduce

    @property
    def compute(self) -> int:
        return self.ctas - self.reduce

    def update(self, s: Signals) -> int:
        """The reduce role's CTAs for the next step."""
        if s.compute_left == 0:                              # nothing to compute: all reduce
            return self._set(self._clamp(self.ctas, s), steady=False)
        total = self._sum
        total[0] += s.computed
        total[1] += s.reduced
        total[2] += s.reduce_wait_permille
        total[3] += 1
        wait = total[2] // total[3]
        # behind: a backlog that is large and still growing (one left from before a
        # correction drains by itself)
        behind = s.backlog > self.backlog_high * self.reduce and s.backlog > self.last_backlog
        self.last_backlog = s.backlog
        self.behind = behind
        idle = wait > self.idle_permille and not behind
        if self.frozen or (total[0] < self.min_tiles and not idle and not behind):
            return self._set(self._clamp(self.reduce, s))
        goal = self._aim(total[0], total[1], wait, behind, idle, s.reduce_ctas or self.reduce)
        self._sum = [0, 0, 0, 0]
        if goal == self.reduce:
            return self._set(self._clamp(self.reduce, s))
        direction = 1 if goal > self.reduce else -1
        move = direction * max(1, abs(goal - self.reduce) // 2)
        if self.last_move and direction != self.last_move and abs(move) == 1:
            self.reversals += 1
            if self.reversals >= self.settle:
                self.frozen = True
                return self._set(self._clamp(self.reduce, s))
        self.last_move = direction
        return self._set(self._clamp(self.reduce + move, s))

    def _aim(self, computed: int, reduced: int, wait: int, behind: bool, idle: bool,
             actual: int) -> int:
        if idle:
            return max(self.min_reduce, self.reduce // 2)
        busy = 1000 - wait
        if computed <= 0 or reduced <= 0 or busy <= 0:
            return self.reduce + 1 if behind else self.reduce
        # per-CTA rates as shares of each role's whole work (the device computes the same
        # doubles in the same order)
        # (rates per CTA of the split that did the work: `actual` reduce CTAs)
        actual = max(1, min(self.ctas - 1, actual))
        c = float(computed) * float(self.reduce_total) / float(self.ctas - actual)
        r = float(reduced) * 1000.0 * float(self.compute_total) / (float(actual) * float(busy))
        # the balance point lies between two splits: take the one whose slower role is faster
        low = int(float(self.ctas) * c / (c + r))
        aim = max((k for k in (low, low + 1) if 1 <= k <= self.ctas - 1),
                  key=lambda k: min((self.ctas - k) * c, k * r), default=self.reduce)
        # A backlog left at the balance point is fine: it drains at the end of the call,
        # when every CTA reduces.
        return aim

    def _set(self, reduce: int, *, steady: bool = True) -> int:
        if reduce != self.reduce:
            self.moves += 1
        self.reduce = reduce
        if steady:
            self.steady = reduce
        return reduce

    def _clamp(self, reduce: int, s: Signals) -> int:
        low = max(self.min_reduce, 1 if s.reduce_left > 0 else 0)
        high = self.ctas - (1 if s.compute_left > 0 else 0)
        return max(low, min(high, reduce))


@dataclasses.dataclass
class SplitMemory:
    """The last split each key (op and shape) ended with; a call starts from it."""

    splits: dict = dataclasses.field(default_factory=dict)

    def start(self, key, default: int) -> int:
        return self.splits.get(key, default)

    def remember(self, key, reduce: int) -> None:
        self.splits[key] = reduce


#: launches a ``roles="search"`` board runs under the rate rule before it searches
RULE_LAUNCHES = 4


@dataclasses.dataclass
class LaunchSearch:
    """``roles="search"``: after the rate rule's first launches, find the split by measuring.

    Each launch runs at a fixed split (no moves within it, every CTA still joins the reduce
    queue at the end); its duration (first CTA in to last CTA out, ``%globaltimer``) is
    averaged over ``samples`` launches per split. From the rule's split a hill climb tries
    best + step, then best - step; a split at least ``min_gain_permille`` faster becomes the
    best and the climb goes on in that direction; with no gain either way the step halves;
    at step 0 it settles on the best. The device runs the same integer arithmetic in the
    last CTA out of each launch (``roles::search_step``)."""

    ctas: int
    start: int
    samples: int = 2
    min_gain_permille: int = 10
    best: int = 0
    best_ns: int = 0           # 0: the best split is not measured yet
    trial: int = 0             # the split the next launches run
    step: int = 0
    down: bool = False         # the climb's direction
    tried_down: bool = False   # best - step tried at this step
    settled: bool = False
    n: int = 0
    sum_ns: int = 0

    def __post_init__(self):
        if self.ctas < 2 or not 1 <= self.start <= self.ctas - 1:
            raise ValueError(f"mkrt.controller: a search needs 1 <= start={self.start} <= "
                             f"ctas - 1 = {self.ctas - 1}")
        self.best = self.trial = self.start
        self.step = max(1, self.ctas // 8)

    def record(self, ns: int) -> int:
        """A launch at `trial` took `ns`; the split of the next launch."""
        self.n += 1
        self.sum_ns += ns
        if self.n < self.samples or self.settled:
            if self.settled:
                self.n = self.sum_ns = 0
            return self.trial
        average = self.sum_ns // self.n
        self.n = self.sum_ns = 0
        if self.best_ns == 0:
            self.best_ns = average                 # the starting split, measured
        elif average * 1000 < self.best_ns * (1000 - self.min_gain_permille):
            self.best, self.best_ns = self.trial, average
            self.tried_down = True                 # the other side is where it came from
        elif not self.down and not self.tried_down:
            self.down = self.tried_down = True
        else:
            self.step //= 2
            self.down = self.tried_down = False
        return self._next()

    def _next(self) -> int:
        while self.step > 0:
            trial = max(1, min(self.ctas - 1, self.best + (-self.step if self.down else self.step)))
            if trial != self.best:
                self.trial = trial
                return trial
            # at the edge: nothing to try this way
            if not self.down and not self.tried_down:
                self.down = self.tried_down = True
            else:
                self.step //= 2
                self.down = self.tried_down = False
        self.settled = True
        self.trial = self.best
        return self.trial
