"""The largest micro-batch whose activation peak stays within a budget, found with few measurements.

A measurement (one batch size, one fresh process) is expensive, and the peak grows nearly linearly
with the batch: ``peak = a + b * batch`` (``a``: what a strategy holds whatever the batch, such as
tba's buffers or the logits' workspace; ``b``: bytes per sample). :func:`find_max_batch`

1. measures the probe batches (smallest first; when the smallest fails outright, the strategy is
   reported as failed and nothing else runs; once a probe is over the budget, larger probes are
   skipped);
2. fits the line by least squares over every successful point and predicts the maximum
   ``m = floor((budget - a) / b)`` (or takes the caller's ``first_guess``: an adaptive plan spends
   the budget at every batch, so its peaks draw no line);
3. confirms by measuring ``m`` and, when ``m`` fits, ``m + 1`` (with a ``tolerance``, ``m`` plus
   that fraction of it): done when ``m`` fits and the second does not; when ``m`` fits far below the
   budget (:data:`CONFIRM_MARGIN`) and the refitted line predicts more, it goes on to the next round;
4. otherwise adjusts, one measurement a round, until a batch that fits sits right below one that
   does not (or, with a ``tolerance``, within that fraction of it): with such a bracket it
   interpolates between the two bracketing points (regula falsi, Illinois variant: when the same
   end moved in several measurements in a row, the other end's weight halves each time, since a
   peak far from the budget drags the interpolation towards it); when the upper end is a failed
   run that said how much memory it needed (:attr:`MeasureError.needed_bytes`, an adaptive plan's
   refusal), it scales that batch by ``budget / needed`` (bisecting instead once a batch above that
   estimate has fitted, which disproves it); else it bisects. Without an upper end it
   refits and extrapolates (Note [Gallop while everything fits]), to at most :data:`MAX_GROWTH`
   times the largest batch that fitted;
   a flat or falling line (an adaptive plan's peaks) doubles that batch instead. A guess at or
   below the largest batch that fitted moves one step above it: one sample, or the tolerance.
   After at most ``rounds`` rounds the largest batch that fitted is reported, marked unconfirmed.

A run that fails (the child process raised, for instance a budget an adaptive plan cannot meet)
counts as a batch that does not fit, and its reason is kept with the point. Peaks that are not
monotonic in the batch (measurement noise) are handled by taking the smallest batch that did not
fit as the upper end and the largest batch below it that fitted as the lower end.

Note: [Gallop while everything fits]
Near the budget the refitted line predicts little more than the batch that just fitted: its
points there sit a few MiB under the budget, and their noise is as large as a step. On
``capacity --preset deep --budget 512M`` offloaded recompute crept 206, 210, 236, 247, 253, 257,
262, 267 (each fitting, about 18 s a run) before 272 was over. So while every measurement fits,
a line that still predicts more room is taken at least ``step * 2^(k - 2)`` above the largest
fitting batch, ``k`` the measurements so far (probes included; all of them fitted): the step doubles
each round until a batch is over, and the interpolation between the two ends takes over from
there. A line whose maximum is the batch that just fitted is confirmed one step above, as before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

MAX_BATCH = 4096
"""Largest batch the search will measure (samples)."""

MAX_GROWTH = 8
"""Without a batch known not to fit, the next guess is at most this many times the largest batch
that fitted: a flat fit (adaptive plans spend the budget at every batch, so their peak barely
grows) extrapolates to :data:`MAX_BATCH`, whose offloading step filled 65 GB of spill disk."""

MAX_ROUNDS = 8
"""Rounds (the confirmation's two measurements, then one each) before the search gives up
confirming. A prediction off by a few percent takes two or three; bisecting below a failed run up to eight."""


CONFIRM_MARGIN = 0.10
"""A guess whose peak is further than this fraction of the budget below it is not confirmed one step
above (that would only fit too; the refitted line guesses next). On ``capacity --preset deep --budget
512M`` offloaded recompute's first guess, 204, peaked at 393 MiB, and the confirmation at 208 cost 15 s
for 400 MiB. Within the margin, near the budget, peaks vary by more than a step between neighbouring
batches (:data:`tba.cli._capacity_run.TOLERANCE`), and the confirmation runs as before."""


class MeasureError(Exception):
    """Raised by a measure function when the run failed; the message is the reason, shown as is.

    ``needed_bytes``: the least activation memory the run said it needed at that batch (an adaptive
    plan refusing the budget), when it said so.
    """

    def __init__(self, reason: str, needed_bytes: int | None = None) -> None:
        super().__init__(reason)
        self.needed_bytes = needed_bytes


@dataclasses.dataclass
class Point:
    """One measurement: batch (samples), activation peak (bytes) and step time (s); ``error`` when it failed."""

    batch: int
    peak_bytes: int | None = None
    step_s: float | None = None
    error: str | None = None
    losses: list[float] = dataclasses.field(default_factory=list)
    needed_bytes: int | None = None

    def fits(self, budget_bytes: int) -> bool:
        return self.error is None and self.peak_bytes is not None and self.peak_bytes <= budget_bytes


@dataclasses.dataclass
class Search:
    """The outcome for one strategy.

    ``max_batch`` is None when the strategy failed at its first probe (``error`` says why), 0 when
    not even the smallest batch fits. ``fit`` is ``(a_bytes, b_bytes_per_sample)``; ``predicted``
    the first prediction; ``confirmed`` True when ``max_batch`` fits and ``max_batch + 1`` was
    measured not to; ``settled`` True when the search ended on its stopping rule (``confirmed``, or
    ``next_over`` within the tolerance, or the cap), not on its round limit; ``next_over`` the
    smallest batch above ``max_batch`` measured not to fit (None when none was); ``capped`` True
    when the search stopped at ``MAX_BATCH``.
    """

    budget_bytes: int
    points: list[Point] = dataclasses.field(default_factory=list)
    max_batch: int | None = None
    fit: tuple[float, float] | None = None
    predicted: int | None = None
    confirmed: bool = False
    settled: bool = False
    next_over: int | None = None
    capped: bool = False
    error: str | None = None

    @property
    def verdict(self) -> str:
        """``yes`` (``max_batch + 1`` was measured over), ``over at N`` (the search settled within its
        tolerance, N the smallest batch measured over), or ``no`` (it ran out of rounds)."""
        if self.confirmed:
            return "yes"
        return f"over at {self.next_over}" if self.settled and self.next_over else "no"

    def point(self, batch: int | None) -> Point | None:
        """The measurement at ``batch``, if one was made."""
        return next((p for p in self.points if p.batch == batch), None)


def linear_fit(points: Sequence[Point]) -> tuple[float, float] | None:
    """Least-squares ``(a, b)`` of ``peak = a + b * batch`` over the successful points; None with none.

    One point (or one distinct batch) gives the line through the origin.
    """
    good = [(p.batch, p.peak_bytes) for p in points if p.error is None and p.peak_bytes is not None]
    if not good:
        return None
    xs = [x for x, _ in good]
    mean_x, mean_y = sum(xs) / len(good), sum(y for _, y in good) / len(good)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0, mean_y / mean_x
    slope = sum((x - mean_x) * (y - mean_y) for x, y in good) / spread
    return mean_y - slope * mean_x, slope


def predict(fit: tuple[float, float], budget_bytes: int, max_batch: int = MAX_BATCH) -> int:
    """Largest batch the line keeps within the budget, in ``0..max_batch``."""
    a, b = fit
    if b <= 0:
        return max_batch if a <= budget_bytes else 0
    return max(0, min(max_batch, math.floor((budget_bytes - a) / b)))


def _bracket(points: Sequence[Point], budget_bytes: int) -> tuple[Point | None, Point | None]:
    """(largest fitting point below the upper end, smallest point that does not fit)."""
    over = [p for p in points if not p.fits(budget_bytes)]
    hi = min(over, key=lambda p: p.batch) if over else None
    under = [p for p in points if p.fits(budget_bytes) and (hi is None or p.batch < hi.batch)]
    return (max(under, key=lambda p: p.batch) if under else None), hi


def _next_guess(points: Sequence[Point], budget_bytes: int, max_batch: int, tolerance: float = 0.0) -> int:
    lo, hi = _bracket(points, budget_bytes)
    lo_batch = lo.batch if lo else 0
    step = _step(lo_batch, tolerance)
    if hi is None:
        fit = linear_fit(points)
        if fit is None or fit[1] <= 0:
            guess = 2 * lo_batch
        else:
            guess = predict(fit, budget_bytes, max_batch)
            if guess <= lo_batch:
                guess = lo_batch + step  # the line's maximum fitted: confirm the batch above it
            else:  # Note [Gallop while everything fits]
                guess = max(guess, lo_batch + step * 2 ** max(0, len(points) - 2))  # no upper end: all fitted
        return min(max(guess, lo_batch + 1), max(MAX_GROWTH * lo_batch, 1), max_batch)
    if lo is not None and hi.error is None and hi.peak_bytes is not None and hi.peak_bytes > lo.peak_bytes:
        under, over = budget_bytes - lo.peak_bytes, hi.peak_bytes - budget_bytes
        fits, run = _last_run(points, budget_bytes)
        if run >= 2:  # Illinois: one end moved ``run`` times in a row, so the other end's weight halves each time
            if fits:
                over /= 2 ** (run - 1)
            else:
                under /= 2 ** (run - 1)
        share = under / (under + over)
        guess = max(lo.batch + math.floor(share * (hi.batch - lo.batch)), lo.batch + step)
    elif hi.needed_bytes and hi.needed_bytes > budget_bytes:
        guess = math.floor(hi.batch * budget_bytes / hi.needed_bytes)
        if guess == lo_batch:
            guess = lo_batch + step  # the estimate fitted: the batch above it
        elif guess < lo_batch:
            guess = (lo_batch + hi.batch) // 2  # a batch above the estimate fitted: it is wrong, so bisect
    else:
        guess = (lo_batch + hi.batch) // 2
    return min(max(guess, lo_batch + 1), hi.batch - 1)


def _step(batch: int, tolerance: float) -> int:
    """How far above ``batch`` the search looks next, and how wide a bracket above it may stay: the
    tolerance's share of it, at least one sample."""
    return max(1, math.floor(tolerance * batch))


def _last_run(points: Sequence[Point], budget_bytes: int) -> tuple[bool, int]:
    """Whether the last measurement fitted, and how many measurements in a row, up to it, did the same."""
    fits = points[-1].fits(budget_bytes)
    run = 0
    for point in reversed(points):
        if point.fits(budget_bytes) != fits:
            break
        run += 1
    return fits, run


def _settled(lo: Point | None, hi: Point | None, max_batch: int, tolerance: float) -> bool:
    """True when no further measurement is wanted: the bracket is one sample wide (or within
    ``tolerance`` of its lower end), or the largest fitting batch is the cap."""
    if lo is not None and lo.batch >= max_batch:
        return True
    if hi is None:
        return False
    lo_batch = lo.batch if lo else 0
    return hi.batch - lo_batch <= _step(lo_batch, tolerance)


def _far_below(search: Search, batch: int, budget_bytes: int, max_batch: int, tolerance: float) -> bool:
    """True when the measurement at ``batch`` fitted with more than :data:`CONFIRM_MARGIN` of the
    budget to spare and the refitted line predicts more than one step above it: measuring the batch
    one step above (the confirmation) would only fit too, so the next round extrapolates instead."""
    point = search.point(batch)
    if point is None or not point.fits(budget_bytes) or point.peak_bytes > budget_bytes * (1 - CONFIRM_MARGIN):
        return False
    return search.fit is not None and predict(search.fit, budget_bytes, max_batch) > batch + _step(batch, tolerance)


def find_max_batch(measure: Callable[[int], Point], budget_bytes: int, *, probes: Sequence[int] = (1, 2),
                   max_batch: int = MAX_BATCH, rounds: int = MAX_ROUNDS, first_guess: int | None = None,
                   tolerance: float = 0.0, on_point: Callable[[Search], None] | None = None) -> Search:
    """Search the largest batch whose measured peak is at most ``budget_bytes`` (see the module's description).

    ``measure(batch)`` returns a :class:`Point` or raises :class:`MeasureError`; ``on_point(search)``
    is called after every measurement (to save partial results). ``first_guess`` replaces the line's
    prediction in the first round. ``tolerance`` (a fraction) ends the search once the smallest batch
    that does not fit is within ``tolerance`` times the largest that does of it (noisy peaks make the
    last sample's verdict a coin toss); 0 searches to one sample.
    """
    search = Search(budget_bytes)

    def run(batch: int) -> None:
        try:
            point = measure(batch)
        except MeasureError as err:
            point = Point(batch, error=str(err), needed_bytes=err.needed_bytes)
        search.points.append(point)
        search.fit = linear_fit(search.points)
        if on_point is not None:
            on_point(search)

    for batch in sorted({min(max(1, b), max_batch) for b in probes}):
        run(batch)
        if all(p.error is not None for p in search.points):
            search.error = search.points[0].error
            return search
        if not search.points[-1].fits(budget_bytes):
            break
    if search.fit is not None:
        search.predicted = predict(search.fit, budget_bytes, max_batch)
    for round_number in range(rounds):
        lo, hi = _bracket(search.points, budget_bytes)
        if _settled(lo, hi, max_batch, tolerance):
            break
        guess = _next_guess(search.points, budget_bytes, max_batch, tolerance)
        if round_number == 0 and first_guess is not None and (lo.batch if lo else 0) < first_guess <= max_batch \
                and (hi is None or first_guess < hi.batch):
            guess = first_guess
        candidates = (guess, guess + _step(guess, tolerance)) if round_number == 0 else (guess,)
        wanted = [b for b in candidates if 1 <= b <= max_batch and search.point(b) is None
                  and (hi is None or b < hi.batch)]
        if not wanted:
            break
        for batch in wanted:
            run(batch)
            if not search.points[-1].fits(budget_bytes) or _far_below(search, batch, budget_bytes, max_batch, tolerance):
                break
    lo, hi = _bracket(search.points, budget_bytes)
    search.max_batch = lo.batch if lo else 0
    search.capped = search.max_batch >= max_batch
    search.next_over = hi.batch if hi is not None else None
    search.confirmed = hi is not None and hi.batch == search.max_batch + 1
    search.settled = _settled(lo, hi, max_batch, tolerance)
    return search
