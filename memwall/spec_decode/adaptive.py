"""How many tokens each sequence drafts: as many as pay for their verification, given how
often its drafts have been accepted and what extra rows cost a step on this machine.

Model: each draft token is accepted with probability a (estimated per sequence), so k drafts
yield E(k) = 1 + a + ... + a^k tokens in one step instead of 1. They also make the step
C(B + k) instead of C(B) for a step of B sequences (``StepCost``, timed at start-up, then
scaled to the steps the engine really runs: ``LearnedStepCost``). At the step's current rate
of B / C(B) tokens per second, the extra time would have bought
(C(B + k) - C(B)) * B / C(B) tokens of plain decoding, so k is worth

    gain(k) = E(k) - 1 - (C(B + k) - C(B) + D(k)) * B / C(B)

where D(k) is what drafting costs the sequence: nothing for prompt lookup; for a draft model, k
of its steps, each the drafter's measured time for a step of B rows shared by the B sequences
(D(k) = k * Cd(B) / B). With ``lookup_first`` a sequence's next drafts come from lookup where
it has a match (``Proposer.drafts_free``, asked before choosing): those are priced with D = 0
and their own estimate of a, kept apart from the drafter's (a chat's lookup drafts were
accepted 60% of the time, its EAGLE head's 35-42%; one estimate for both made lookup draft
short and the head long). The sequence drafts the k with the largest gain, or nothing when no k
gains more than MIN_GAIN tokens. That is what keeps speculation from making open chat slower: a
sequence whose drafts keep failing stops drafting. While it does not draft its estimate drifts
back to the prior, so it tries again now and then (text changes: a chat turns to quoting code).
Where the price keeps every sequence from drafting, one draft is tried now and then
(``PROBE_AFTER``) while its step's row count was never timed: a cost guessed too high from the
start-up table is measured instead of kept. A probe is the step's only draft: the sequences
after it would price their rows past the probe's, and at 16 sequences that is past the start-up
table's step up at 17 rows, where it is cheap (1.1 ms a row against 3.3 measured: the table
times matmuls, not each row's attention), so each added 2 drafts and one probe made a 47-row
step (a Cascade Lake Xeon, c=16: 110-400 verifies a 64-request run, 0.86-0.89x of plain). The
mirror: where every step drafts, one step now and then drafts nothing while a plain step of its
sequences was never timed (a price too low is measured too).

The sequences of one step choose in turn, each against the rows the ones before it already
added (R = B + their drafts): its k costs C(R + k) - C(R), not C(B + k) - C(B). Sixteen
sequences that each priced their drafts as if alone made 36-80-row steps out of 16-row ones
(c=16 serving at 0.89-0.93x of no speculation).

What a drafter with a model of its own really costs is also timed as it runs
(``observe_drafting``: the proposer's wall time per drafted token, Python included); D(k) takes
the larger of that and the start-up figure, which covers the drafter's matmuls only (an EAGLE
head's drafted token measured 0.24x a step there but cost more in the proposer, and chat ran
at 0.90x). Prompt lookup stays free (no ``draft_cost``): its lookups take microseconds, and on
a tiny model they would be weighed against a step timed without Python.

No drafts while a prompt is still being read (worker/runner.py): the step that carries its
next chunk goes the prefill way, and its drafts, priced as that step's tokens, lost (alternating
in one process, 9 rounds each: c=16 0.88x of plain by medians with them, 1.08x without; c=4
1.03x and 1.11x; the drafts take step budget from the prompt, and each needs a row of the LM
head).

The estimate is the maximum-likelihood one for that model, over decayed counts: every draft
position examined is a trial (accepted ones, plus the first rejected one if any).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

PRIOR_RATE = 0.6  # acceptance assumed before any evidence (drafts exist only on a match)
PRIOR_TRIALS = 2.0  # its weight, in draft positions
DECAY = 0.8  # per verify: the estimate follows the last few steps
IDLE_DECAY = 0.9  # per step without drafts: back towards the prior
MIN_GAIN = 0.05  # tokens a step must gain for drafting to be worth its overhead
DRAFT_TIME_DECAY = 0.9  # per proposer call: the running figure of seconds a drafted token
PROBE_AFTER = 32  # steps without a draft, after which a row count never timed is tried once


class StepCost:
    """Seconds a step of n one-token rows takes (linear between the measured sizes).

    The table is made monotone: a step of n rows is taken to cost at most what a step of more
    rows measured. Noise only ever adds time, and a table that prices a row count too high is
    never corrected by the steps the engine runs: sequences then do not draft, and no step of
    that many rows is seen (LearnedStepCost). Measured on a 2-core EPYC, one start-up timed 1
    row at 7.25 ms and 4 rows at 6.49 ms: 2 rows then cost 2 ms more than 1 (~0.3 of a step),
    and an EAGLE run drafted 43 tokens in 8 chats (14 verifications in ~1,000 steps)."""

    def __init__(self, seconds: dict[int, float]) -> None:
        if not seconds or min(seconds) < 1:
            raise ValueError(f"need step times for row counts >= 1, got {sorted(seconds)}")
        self.sizes = sorted(seconds)
        self.seconds = [seconds[n] for n in self.sizes]
        for i in range(len(self.seconds) - 2, -1, -1):
            self.seconds[i] = min(self.seconds[i], self.seconds[i + 1])

    def __call__(self, rows: int) -> float:
        sizes, secs = self.sizes, self.seconds
        if rows <= sizes[0]:
            return secs[0] * rows / sizes[0]
        i = bisect.bisect_left(sizes, rows)
        if i == len(sizes):  # past the last size: the last measured slope goes on
            lo, hi = (len(sizes) - 2, len(sizes) - 1) if len(sizes) > 1 else (0, 0)
        else:
            lo, hi = i - 1, i
        if sizes[hi] == sizes[lo]:
            return secs[lo] * rows / sizes[lo]
        slope = (secs[hi] - secs[lo]) / (sizes[hi] - sizes[lo])
        return secs[lo] + slope * (rows - sizes[lo])


class LearnedStepCost:
    """The start-up table's shape, scaled to the steps the engine really ran.

    The start-up figures time the matmuls and the LM head of n rows, best of three, and miss
    what a row also costs in a real step: its sequence's attention (a row of 700 keys reads and
    multiplies every cached key of every layer), sampling or verifying it, and the Python
    around both. Measured on a 2-core EPYC in a 16-request serving run, a step's real marginal
    row cost was 1.4-1.5 ms against the table's 0.9, and the table itself swung between
    start-ups (one row timed slower than two). Priced with it, sequences drafted where drafting
    lost: c=16 serving ran at 0.91-0.95x of no speculation.

    So the runner reports every decode/verify step's wall time (``observe``, prefill chunks
    excluded: they are priced by the budget, not here) and ``cost(n)`` is the running average
    of steps of n rows once ``MIN_SAMPLES`` were seen. A row count not seen yet takes the
    start-up figure times the observed / start-up ratio of the seen counts around it
    (interpolated between the nearest below and above, or the nearest one on one side): the
    table keeps its shape, e.g. the step up past 16 rows where the int8 kernels change, and the
    steps seen set its scale; above every count seen, no less than the seen counts' own slope
    goes on (``_past_seen``). Outliers (a page fault, the OS taking a core) are clamped to
    within ``CLAMP`` times the running figure.
    """

    MIN_SAMPLES = 3  # steps of a row count before their average replaces the table
    ALPHA = 0.1  # weight of each new step in the running average (~ the last 10 steps)
    CLAMP = 2.0  # a step counts as at most this many times the running figure (and 1/CLAMP)
    SLOPE_SPAN = 4  # rows between the seen counts a count past them takes its slope from

    def __init__(self, startup: StepCost) -> None:
        self.startup = startup
        self._seconds: dict[int, float] = {}  # rows -> running average of observed steps
        self._counts: dict[int, int] = {}
        self._seen: list[int] = []  # sorted row counts with MIN_SAMPLES steps or more
        self._priced: dict[int, float] = {}
        """rows -> cost since the last observed step: every sequence of a step prices the same
        row counts (16 sequences x 5 counts a 16-row step took 0.19 of _propose's 0.28 s in a
        32-request run), and a cost changes only when a step is observed."""

    def observe(self, rows: int, seconds: float) -> None:
        """A decode/verify step of ``rows`` rows took ``seconds`` (wall time, Python included)."""
        if rows < 1 or seconds <= 0:
            return
        self._priced.clear()
        count = self._counts.get(rows, 0)
        if count == 0:
            self._seconds[rows] = seconds
        else:
            current = self._seconds[rows]
            sample = min(max(seconds, current / self.CLAMP), current * self.CLAMP)
            weight = max(self.ALPHA, 1.0 / (count + 1))  # a plain mean until 1/ALPHA steps
            self._seconds[rows] = current + weight * (sample - current)
        self._counts[rows] = count + 1
        if count + 1 == self.MIN_SAMPLES:
            bisect.insort(self._seen, rows)

    def samples(self, rows: int) -> int:
        return self._counts.get(rows, 0)

    def _ratio(self, rows: int) -> float:
        return self._seconds[rows] / self.startup(rows)

    def __call__(self, rows: int) -> float:
        seconds = self._priced.get(rows)
        if seconds is None:
            seconds = self._priced[rows] = self._price(rows)
        return seconds

    def _past_seen(self, rows: int) -> float:
        """A count above every count seen, at the slope the seen steps show below the top
        one (over at least SLOPE_SPAN rows where they reach that far; 0 with one count seen).
        The start-up table times matmuls and the LM head, not each row's attention, sampling
        and Python, so its slope is too low where rows are compute-bound: past 16 rows on a
        Cascade Lake Xeon 1.1 ms a row against 3.2-3.4 ms learned at c=16, and its rows there
        drafted where they cost more than they brought."""
        seen, top = self._seen, self._seen[-1]
        below = [n for n in seen if n <= top - self.SLOPE_SPAN]
        low = below[-1] if below else seen[0]
        if low == top:
            return 0.0
        slope = (self._seconds[top] - self._seconds[low]) / (top - low)
        return self._seconds[top] + max(0.0, slope) * (rows - top)

    def _price(self, rows: int) -> float:
        seen = self._seen
        if not seen:
            return self.startup(rows)
        i = bisect.bisect_left(seen, rows)
        if i < len(seen) and seen[i] == rows:
            return self._seconds[rows]
        if i == 0:
            ratio = self._ratio(seen[0])
        elif i == len(seen):
            return max(self.startup(rows) * self._ratio(seen[-1]), self._past_seen(rows))
        else:
            lo, hi = seen[i - 1], seen[i]
            ratio = self._ratio(lo) + (self._ratio(hi) - self._ratio(lo)) * (rows - lo) / (hi - lo)
        return self.startup(rows) * ratio


class DraftRowPrice:
    """What a step's draft rows cost, as a fraction of a plain step of the same sequences
    timed moments before: drift-proof and batch-aware where LearnedStepCost is neither.

    LearnedStepCost keeps one running figure per row count. On a VM whose speed swung 35-58 ms
    for the same 16-row plain step within seconds (session 33, a Cascade Lake Xeon, c=16), a
    count seen rarely keeps the speed of the moments it was seen at, and a count is a mix of
    batches: 16 rows as 11 sequences + 5 drafts took 35 ms, as 16 sequences 51 ms (fewer
    contexts to attend). A 20-row count timed while 5 sequences verified 15 drafts came out
    cheaper than 16 rows, and every sequence of the next 16-sequence steps drafted 4 (80-row
    steps; 0.88x of no speculation in an interleaved c=16 run). So each verify step of B
    sequences and d drafts is divided by the running figure of plain steps of B sequences
    (``REF_ALPHA``: the last few), and that fraction is learned per (B, d); a d not seen at B
    is interpolated between the seen ones (through 1.0 at d = 0; past the largest, at its
    average slope). Where B has no verify step seen yet, LearnedStepCost prices.

    It cannot price drafting out for good: one verify step counts as at most ``CLAMP`` times
    its fraction (a step the OS interrupted), and where a batch's fractions were
    not refreshed for ``STALE_STEPS`` steps (``stale``) DraftLengths tries one draft now and
    then (batch-1 grounded prompts once stopped drafting for a whole run after one slow verify
    step had priced every draft count at 3 plain steps). Forgetting them instead handed c=16
    back to the row-count prices every 512 steps, which drafted again (0.95x).

    A price too high is refreshed only by the steps it prevents, so three more guards: a step
    replaces a (B, d) fraction older than ``STALE_STEPS`` steps instead of moving it by
    ``ALPHA`` (a quarter of the way a probe, one probe each STALE_STEPS steps, took ~6 probes,
    ~3,000 steps, to bring a doubled price back); the first step of a draft count is taken at
    most ``CLAMP`` times what the counts seen price it at (a busy core timed one 2-draft step of
    an EAGLE run at 13 plain steps, and 2 drafts were never tried again that run); and
    DraftLengths drafts one more than pays, once, where that count's price is stale
    (``retime_due``: the re-probe above only ever tries one draft). Seen on a Cascade Lake Xeon
    whose VM ran at half speed in the first of three EAGLE runs: the third verified 117 times in
    ~2,300 steps (0.99x of plain)."""

    REF_ALPHA = 0.3  # weight of each plain step in its batch's running figure
    REF_MAX_AGE = 16  # steps after which a batch's plain figure is too old to compare with
    ALPHA = 0.25  # weight of each verify step in its (batch, drafts) fraction
    CLAMP = 2.0  # a verify step counts as at most this many times its running fraction
    STALE_STEPS = 512  # steps after which a batch's fractions, not seen again, are re-probed
    MAX_FRACTION = 64.0  # one verify step counts as at most this many plain steps

    def __init__(self) -> None:
        self._plain: dict[int, tuple[float, int]] = {}  # B -> (running seconds, step seen at)
        self._fractions: dict[int, dict[int, float]] = {}  # B -> d -> running fraction
        self._seen_at: dict[int, dict[int, int]] = {}  # B -> d -> the step d's fraction last moved
        self._retimed_at: dict[tuple[int, int], int] = {}  # (B, d) -> step retime_due said so
        self._priced: dict[tuple[int, int], float] = {}  # (B, rows) -> fraction, until one moves
        self._step = 0

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        """A decode/verify step of ``batch`` sequences and ``rows`` rows took ``seconds``."""
        self._step += 1
        if batch < 1 or rows < batch or seconds <= 0:
            return
        ref = self._plain.get(batch)
        if rows == batch:
            figure = seconds if ref is None else ref[0] + self.REF_ALPHA * (seconds - ref[0])
            self._plain[batch] = (figure, self._step)
            return
        if ref is None or self._step - ref[1] > self.REF_MAX_AGE:
            return
        sample = min(max(seconds / ref[0], 1.0), self.MAX_FRACTION)
        seen = self._fractions.setdefault(batch, {})
        d = rows - batch
        seen_at = self._seen_at.setdefault(batch, {})
        fresh = self._step - seen_at.get(d, self._step) <= self.STALE_STEPS
        if d in seen and fresh:  # one step counts as at most CLAMP times the running fraction
            sample = seen[d] + self.ALPHA * (min(sample, seen[d] * self.CLAMP) - seen[d])
        elif d not in seen and seen:  # a first step of d: at most CLAMP times the price the
            # counts seen gave it (one 2-draft step timed at 13 plain steps by a busy core priced
            # 2 drafts out for the rest of the run)
            sample = min(sample, self._fraction(batch, rows) * self.CLAMP)
        seen[d] = sample  # new, or older than STALE_STEPS: this step's figure replaces it
        seen_at[d] = self._step
        self._priced.clear()

    def knows(self, batch: int) -> bool:
        return batch in self._fractions and batch in self._plain

    def retime_due(self, batch: int, drafts: int) -> bool:
        """True, once per STALE_STEPS steps and count, where the batch's fraction for ``drafts``
        draft rows was seen but not for STALE_STEPS steps: DraftLengths then drafts that many,
        to time it anew. Once, because that step may not be timed (no plain step of late to
        compare it with), and asking again each step would draft one more every step."""
        key = (batch, drafts)
        seen_at = self._seen_at.get(batch, {}).get(drafts)
        if (seen_at is None or self._step - seen_at <= self.STALE_STEPS
                or self._step - self._retimed_at.get(key, -self.STALE_STEPS) <= self.STALE_STEPS):
            return False
        self._retimed_at[key] = self._step
        return True

    def stale(self, batch: int) -> bool:
        """True where ``batch``'s fractions are known but none was seen for STALE_STEPS steps."""
        seen_at = self._seen_at.get(batch)
        return bool(seen_at) and self._step - max(seen_at.values()) > self.STALE_STEPS

    def plain_seconds(self, batch: int) -> float:
        return self._plain[batch][0]

    def fraction(self, batch: int, rows: int) -> float:
        """A step of ``batch`` sequences and ``rows`` rows, as a multiple of its plain step;
        never below that of fewer drafts seen. Kept until a fraction moves: every sequence of
        a step prices the same counts (4 sequences: 0.06 of _propose's 0.19 s in a run)."""
        value = self._priced.get((batch, rows))
        if value is None:
            value = self._priced[(batch, rows)] = self._fraction(batch, rows)
        return value

    def _fraction(self, batch: int, rows: int) -> float:
        d = rows - batch
        if d <= 0:
            return 1.0
        seen = self._fractions[batch]
        below = max((n for n in seen if n <= d), default=0)
        above = min((n for n in seen if n > d), default=None)
        f_below = seen[below] if below else 1.0
        if below == d:
            value = f_below
        elif above is not None:
            value = f_below + (seen[above] - f_below) * (d - below) / (above - below)
        else:  # past every count seen: their average slope goes on
            value = f_below + (f_below - 1.0) / below * (d - below)
        return max([value, *(f for n, f in seen.items() if n < d)])


@dataclass
class _Estimate:
    accepted: float = PRIOR_RATE * PRIOR_TRIALS
    trials: float = PRIOR_TRIALS

    @property
    def rate(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else PRIOR_RATE


def expected_tokens(rate: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens a step yields with k drafts accepted at rate a."""
    return float(sum(rate ** i for i in range(k + 1)))


class DraftLengths:
    """Per-sequence draft lengths (``adaptive=False``: always ``max_k``)."""

    def __init__(self, max_k: int, cost: StepCost | None, adaptive: bool = True,
                 draft_cost: StepCost | None = None) -> None:
        """``cost``: the target's step of n rows at start-up, learned from the real steps from
        then on (``observe_step``); ``draft_cost``: the drafter's (None: free)."""
        self.max_k, self.adaptive = max_k, adaptive and cost is not None
        self.cost = LearnedStepCost(cost) if cost is not None else None
        self.row_price = DraftRowPrice() if cost is not None else None
        self.draft_cost = draft_cost
        self.drafting_s: float | None = None  # measured seconds per drafted token (a sequence's)
        self._estimates: dict[tuple[str, bool], _Estimate] = {}  # (request, free drafts)
        self._priced_free: dict[str, bool] = {}  # whether a sequence's last choice was free
        self._quiet_steps = 0  # steps in a row in which no sequence drafted (end_step)
        self._probing = False  # a sequence of this step took a probe: the others draft nothing
        self._busy_steps = 0  # steps in a row in which some sequence drafted (end_step)

    def rate(self, request_id: str, free: bool = False) -> float:
        """The sequence's acceptance estimate for drafts of that kind (``free``: prompt lookup's,
        which cost no drafting time; else the drafter's)."""
        return self._estimates.get((request_id, free), _Estimate()).rate

    def knows(self, request_id: str) -> bool:
        """True once a verification of the sequence's drafts was seen."""
        return (request_id, False) in self._estimates or (request_id, True) in self._estimates

    def choose(self, request_id: str, batch: int, drafted: int = 0, free: bool = False) -> int:
        """Drafts for this sequence's next step, in a step of ``batch`` sequences to which the
        sequences that chose before it added ``drafted`` draft rows. ``free``: they will come
        from prompt lookup (``Proposer.drafts_free``): no drafting time, and their own
        acceptance estimate (lookup_first.py: a chat's lookup drafts were accepted 60% of the
        time, its EAGLE head's 35-42%; one estimate for both priced each kind wrong)."""
        return self.choose_among(request_id, batch, drafted, (free,))[0]

    def choose_among(self, request_id: str, batch: int, drafted: int,
                     kinds: tuple[bool, ...]) -> tuple[int, bool]:
        """(drafts, free) for this sequence's next step: the kind of drafts (``free``: prompt
        lookup's; else the drafter's) and count that gain the most, as ``choose`` prices
        each. A sequence with a lookup match under ``lookup_first`` may draft either way:
        lookup's drafts cost nothing but may be accepted far less often than a draft model's
        (90% on HumanEval for Qwen2.5-Coder-0.5B)."""
        if not self.adaptive:
            return self.max_k, kinds[0]
        if self._probing or self._plain_probe_due(batch):
            return 0, kinds[0]
        best_k, best_gain, best_free = 0, MIN_GAIN, kinds[0]
        for free in kinds:
            k, gain = self._best(request_id, batch, drafted, free)
            if k and gain > best_gain:
                best_k, best_gain, best_free = k, gain, free
        self._priced_free[request_id] = best_free
        rows = max(1, batch) + max(0, drafted)
        if 0 < best_k < self.max_k and self.row_price.retime_due(max(1, batch),
                                                                max(0, drafted) + best_k + 1):
            # one draft more than pays, where that count's price is old: it is timed only by
            # the steps it prevents (the probe below tries one draft), so a price raised in a
            # slow moment would stand for good
            return best_k + 1, best_free
        if best_k == 0 and drafted <= 0 and (self._probe_due(rows + 1) or self._reprobe_due(batch)):
            self._quiet_steps, self._probing = 0, True
            return 1, best_free
        return best_k, best_free

    def could_draft(self, batch: int, rate: float) -> bool:
        """Whether any sequence of a step of ``batch`` could draft, none having a better
        acceptance estimate than ``rate``: free drafts at that rate gain enough, or a probe
        is due. False lets the runner skip pricing each sequence (with n-gram drafts, 32
        requests of 128 tokens at c=16 on a Cascade Lake Xeon: 0.35 -> 0.13 ms of a 16-row
        step that drafts nothing): drafts of another kind cost drafting time on top, and a
        lower rate gains less, so none of them would draft either."""
        if not self.adaptive:
            return True
        batch = max(1, batch)
        return (self._best_at(rate, batch, 0, 0.0)[0] > 0 or self._probe_due(batch + 1)
                or self._reprobe_due(batch))

    def _best(self, request_id: str, batch: int, drafted: int, free: bool) -> tuple[int, float]:
        """The draft count with the largest gain over MIN_GAIN for drafts of one kind, and
        that gain ((0, MIN_GAIN) where none passes)."""
        batch = max(1, batch)
        drafting = 0.0  # lookup's drafts cost no drafting time
        if not free and self.draft_cost is not None:
            drafting = self.draft_cost(batch) / batch
        if not free and self.drafting_s is not None:
            drafting = max(drafting, self.drafting_s)
        return self._best_at(self.rate(request_id, free), batch, drafted, drafting)

    def _best_at(self, rate: float, batch: int, drafted: int, drafting: float) -> tuple[int, float]:
        """``_best`` for drafts accepted at ``rate`` that cost ``drafting`` seconds each."""
        rows = batch + max(0, drafted)
        cost = self.cost  # seconds of a step of n rows
        if self.row_price is not None and self.row_price.knows(batch):
            # a fraction of a plain step of these sequences, timed moments before
            price, plain = self.row_price, self.row_price.plain_seconds(batch)

            def cost(n: int) -> float:
                return price.fraction(batch, n) * plain
        base = cost(rows)
        best_k, best_gain = 0, MIN_GAIN
        for k in range(1, self.max_k + 1):
            # never below nothing: steps of a count seen cold (one-row steps follow prefills)
            # can average above those of the next, and a row priced below zero is drafted
            # whatever its acceptance
            extra = max(0.0, cost(rows + k) - base) + k * drafting
            gain = expected_tokens(rate, k) - 1.0 - extra * batch / base
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k, best_gain

    def _probe_due(self, rows: int) -> bool:
        """A draft now, against the price: after PROBE_AFTER steps without one, where a step
        of ``rows`` rows was never timed (LearnedStepCost.MIN_SAMPLES). Such a count is priced
        from the start-up table alone, and a price too high there would stand for good: the
        steps that would correct it are the ones it keeps from running. A probe costs a row;
        at most MIN_SAMPLES probes a row count."""
        return (self._quiet_steps >= PROBE_AFTER
                and self.cost.samples(rows) < LearnedStepCost.MIN_SAMPLES)

    def _reprobe_due(self, batch: int) -> bool:
        """A draft now, against the price: after PROBE_AFTER steps without one, where the
        batch's draft-row fractions were not refreshed for DraftRowPrice.STALE_STEPS steps
        (a fraction priced too high keeps the verify steps that would lower it from running)."""
        return (self._quiet_steps >= PROBE_AFTER and self.row_price is not None
                and self.row_price.stale(max(1, batch)))

    def _plain_probe_due(self, batch: int) -> bool:
        """A step without drafts now, against the price: after PROBE_AFTER steps that all had
        drafts, where a plain step of ``batch`` rows was never timed. The mirror of
        ``_probe_due``: a start-up table that times 17 rows no dearer than 16 (made monotone,
        one noisy timing does that) prices a sixteenth sequence's draft row at nothing; the
        learned cost of 16 rows then follows 17's, since no plain 16-row step is ever run to
        time it, and every step of a c=16 run verified a draft (a Cascade Lake Xeon: 17 rows
        timed 15 times, 16 never). At most MIN_SAMPLES such steps a row count."""
        return (self._busy_steps >= PROBE_AFTER
                and self.cost.samples(max(1, batch)) < LearnedStepCost.MIN_SAMPLES)

    def end_step(self, drafted: bool) -> None:
        """Once a step, after its sequences chose: whether any of them drafts. A step without
        drafts moves the measured drafting time back towards the start-up figure: a figure
        too high (one slow call) would otherwise stand for good, since only drafting calls
        update it and it keeps them from happening (as the acceptance estimates drift back to
        their prior, ``idle``)."""
        self._quiet_steps = 0 if drafted else self._quiet_steps + 1
        self._busy_steps = self._busy_steps + 1 if drafted else 0
        self._probing = False
        if not drafted and self.drafting_s is not None:
            floor = self.draft_cost(1) if self.draft_cost is not None else 0.0
            if self.drafting_s > floor:
                self.drafting_s = floor + DRAFT_TIME_DECAY * (self.drafting_s - floor)

    def observe_step(self, rows: int, seconds: float, batch: int | None = None) -> None:
        """The target ran a decode/verify step of ``rows`` rows (``batch`` sequences, where
        known) in ``seconds``."""
        if self.cost is not None:
            self.cost.observe(rows, seconds)
            if batch is not None:
                self.row_price.observe(batch, rows, seconds)

    def observe_drafting(self, seconds: float, tokens: int) -> None:
        """The proposer spent ``seconds`` drafting ``tokens`` tokens (all its sequences'); a
        free drafter (no ``draft_cost``: prompt lookup) keeps counting as free. The caller
        leaves out a call that drafted a sequence's first tokens: that call also fed the
        drafter the sequence's prompt, paid once a sequence, not by each drafted token (an
        EAGLE head's first call on a chat took 3.9 ms for 2 drafts, its next ones ~0.9 ms a
        draft; a draft model's reads the prompt through a model of its own)."""
        if tokens <= 0 or self.draft_cost is None:
            return
        per_token = seconds / tokens
        self.drafting_s = (per_token if self.drafting_s is None else
                           DRAFT_TIME_DECAY * self.drafting_s + (1 - DRAFT_TIME_DECAY) * per_token)

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` tokens accepted the first ``accepted`` of them."""
        if drafted <= 0:
            return
        key = (request_id, self._priced_free.get(request_id, False))
        est = self._estimates.setdefault(key, _Estimate())
        est.accepted = est.accepted * DECAY + accepted
        est.trials = est.trials * DECAY + accepted + (1 if accepted < drafted else 0)

    def idle(self, request_id: str) -> None:
        """A step in which the sequence verified nothing: its evidence (of both kinds) ages."""
        for free in (False, True):
            est = self._estimates.get((request_id, free))
            if est is not None:
                est.accepted = est.accepted * IDLE_DECAY + PRIOR_RATE * PRIOR_TRIALS * (1 - IDLE_DECAY)
                est.trials = est.trials * IDLE_DECAY + PRIOR_TRIALS * (1 - IDLE_DECAY)

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._estimates.pop((request_id, False), None)
            self._estimates.pop((request_id, True), None)
            self._priced_free.pop(request_id, None)
