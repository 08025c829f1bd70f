"""The confirmation race: new runs of the auto row against its closest sweep rivals.

Picking the best of many noisy sweep rows and judging it with the same runs favours
it (a maximum over samples), so the verdict comes from new rounds of auto and the
few rows that matter. On a noisy machine a fixed number of rounds is either too few
(intervals wider than the 3 % target) or wasted on rivals that were clear early, so
the rounds race: after round ``first_look`` and every ``look_every`` rounds, a rival
whose interval lies wholly on one side of the target leaves; the race ends when none
is left or after ``max_rounds``. Looking repeatedly would make a verdict more likely
by chance, so every interval uses Pocock's constant for the planned number of looks
(a 95 % chance overall that no look wrongly decides a rival), with Student's t for
the rounds seen so far.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from megatron_seq1f1b.bench.lineup import AUTO_KEY, SWEEP_KEY, BenchSchedule

AUTO_TARGET = 0.97  # the auto plan's tokens/s at least this share of the best measured k

# Pocock's constant: the |z| bound that K equally spaced looks at a normal statistic cross
# with total chance 5 % (Pocock 1977; Jennison & Turnbull, table 2.1).
_POCOCK = {1: 1.960, 2: 2.178, 3: 2.289, 4: 2.361, 5: 2.413, 6: 2.453, 7: 2.485, 8: 2.512,
           9: 2.535, 10: 2.555, 11: 2.572, 12: 2.588, 15: 2.626, 20: 2.672}


def pocock(looks: int) -> float:
    """The bound for ``looks`` looks (the next tabulated count up: slightly conservative)."""
    return _POCOCK[min((k for k in _POCOCK if k >= looks), default=max(_POCOCK))]


def _t_within(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer ``df`` (closed form, Abramowitz-Stegun 26.7)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 c2 + 2*4/(3*5) c2^2 + ...))
        series, term = 0.0, 1.0
        for j in range(1, (df - 1) // 2 + 1):
            series += term
            term *= c2 * (2 * j) / (2 * j + 1)
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series)
    series, term = 0.0, 1.0  # even: sin (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ...)
    for j in range(1, df // 2 + 1):
        series += term
        term *= c2 * (2 * j - 1) / (2 * j)
    return math.sin(theta) * series


def t_bound(z: float, df: int) -> float:
    """Student's t bound with the same two-sided tail as the normal bound ``z``."""
    inside = 1.0 - math.erfc(z / math.sqrt(2))
    low, high = z, z * 10 + 1e3
    for _ in range(200):  # bisection: _t_within rises in t
        mid = (low + high) / 2
        low, high = (mid, high) if _t_within(mid, df) < inside else (low, mid)
    return (low + high) / 2


def ratio_interval(ratios: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios and its interval (t on the log ratios, normal
    bound ``z``: 1.96 for one look)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = t_bound(z, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def same_plan(a: BenchSchedule, b: BenchSchedule) -> bool:
    """Whether two rows run the same plan (segments and schedule variant) on the same layout."""
    return (a.lengths == b.lengths and a.schedule == b.schedule and a.layout == b.layout
            and a.megatron == b.megatron and a.recompute == b.recompute)


def sweep_twin(schedules: list[BenchSchedule], auto: BenchSchedule) -> BenchSchedule | None:
    """The sweep row that runs exactly the auto plan, if any: a control whose true ratio is 1."""
    return next((s for s in schedules if SWEEP_KEY.fullmatch(s.key) and same_plan(s, auto)),
                None)


def closest_rivals(schedules: list[BenchSchedule], count: int,
                   auto: BenchSchedule | None = None) -> list[BenchSchedule]:
    """The `count` sweep rows with the shortest median time (the confirmation's rivals),
    leaving out the row that runs ``auto``'s own plan (beating itself is noise)."""
    sweep = [s for s in schedules if SWEEP_KEY.fullmatch(s.key)
             and (auto is None or not same_plan(s, auto))]
    return sorted(sweep, key=lambda s: statistics.median(s.times))[:count]


@dataclass(frozen=True)
class Race:
    """When the confirmation looks at its rounds, and so how wide its intervals are.

    ``twin``: the key of a sweep row that runs auto's own plan. Its ratio (true value 1)
    shows the noise; its runs and auto's are samples of one plan, so per round auto's
    time is the geometric mean of the two (half the variance on auto's side). It runs
    as long as any rival does and is never one.
    """

    max_rounds: int
    target: float = AUTO_TARGET
    first_look: int = 8
    look_every: int = 4
    twin: str | None = None

    def looks(self) -> list[int]:
        """The rounds after which rivals may leave (the last one ends the race)."""
        return [*range(self.first_look, self.max_rounds, self.look_every), self.max_rounds]

    @property
    def z(self) -> float:
        return pocock(len(self.looks()))

    def auto_times(self, times: dict[str, list[float]]) -> list[float]:
        """Auto's time per round, pooled with the twin's runs where one exists."""
        auto = times[AUTO_KEY]
        if self.twin is None:
            return auto
        return [math.sqrt(a * t) for a, t in zip(auto, times[self.twin])]

    def rival(self, times: dict[str, list[float]], key: str) -> dict:
        """Auto / rival per round (rival time over auto's), its mean and interval."""
        ratios = [r / a for a, r in zip(self.auto_times(times), times[key])]
        mean, low, high = ratio_interval(ratios, self.z)
        decided = "hit" if low >= self.target else "miss" if high < self.target else None
        return {"ratios": ratios, "ratio": mean, "low": low, "high": high, "rounds": len(ratios),
                "decided": decided, "median_s": statistics.median(times[key])}

    def racing(self, times: dict[str, list[float]]) -> list[str]:
        """The rows (rivals, and the twin while any rival is left) that run the next round."""
        done = len(times[AUTO_KEY])
        if done >= self.max_rounds:
            return []
        running = [k for k, v in times.items() if k not in (AUTO_KEY, self.twin)
                   and len(v) == done]
        if done in self.looks():
            running = [k for k in running if self.rival(times, k)["decided"] is None]
        return running + ([self.twin] if running and self.twin else [])


def confirmation(times: dict[str, list[float]], race: Race | None = None) -> dict:
    """Auto's tokens/s over each rival's in the confirmation rounds, and the verdict.

    ``race`` defaults to one look after the rounds given. The verdict is "miss" if auto
    is surely short of the target against any rival, "hit" if surely within it against
    all, else "hit/miss within noise" by the rival that beats auto most.
    """
    race = race or Race(max_rounds=len(times[AUTO_KEY]))
    auto = race.auto_times(times)
    control = None
    if race.twin is not None:
        ratios = [t / a for a, t in zip(times[AUTO_KEY], times[race.twin])]
        mean, low, high = ratio_interval(ratios, race.z)
        control = {"key": race.twin, "ratios": ratios, "ratio": mean, "low": low, "high": high,
                   "median_s": statistics.median(times[race.twin])}
    rivals = {key: race.rival(times, key) for key in times if key not in (AUTO_KEY, race.twin)}
    worst_key = min(rivals, key=lambda k: rivals[k]["ratio"])
    worst = rivals[worst_key]
    if any(r["high"] < race.target for r in rivals.values()):
        verdict = "miss"
    elif all(r["low"] >= race.target for r in rivals.values()):
        verdict = "hit"
    else:
        verdict = "hit within noise" if worst["ratio"] >= race.target else "miss within noise"
    return {"rounds": len(auto), "max_rounds": race.max_rounds, "looks": race.looks(),
            "z": race.z, "auto_median_s": statistics.median(auto), "rivals": rivals,
            "same_plan": control, "against": worst_key, "ratio": worst["ratio"],
            "interval": [worst["low"], worst["high"]], "verdict": verdict,
            "hit": worst["ratio"] >= race.target}
