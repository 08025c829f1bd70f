"""Per-operator profiles of schedules side by side: where a Seq1F1B iteration spends
CPU time that Megatron's does not (calls and self time per operator, torch.profiler).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OpTotals:
    """One run's operators: name -> (calls, self CPU milliseconds)."""

    ops: dict[str, tuple[int, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, events) -> OpTotals:
        """From ``torch.profiler.profile.key_averages()``."""
        return cls({e.key: (int(e.count), e.self_cpu_time_total / 1e3) for e in events})

    @property
    def calls(self) -> int:
        return sum(c for c, _ in self.ops.values())

    @property
    def self_ms(self) -> float:
        return sum(ms for _, ms in self.ops.values())


def side_by_side(totals: dict[str, OpTotals], rows: int = 30) -> str:
    """A markdown table: the operators whose self time differs most from the first
    schedule's (the baseline), calls and self milliseconds per schedule, and the totals."""
    keys = list(totals)
    base = totals[keys[0]]
    names = set().union(*(t.ops for t in totals.values()))

    def spread(name: str) -> float:
        ms = [t.ops.get(name, (0, 0.0))[1] for t in totals.values()]
        return max(abs(x - base.ops.get(name, (0, 0.0))[1]) for x in ms) + 1e-9 * max(ms)

    head = "| operator | " + " | ".join(f"{k} calls | {k} ms" for k in keys) + " |"
    rule = "|---|" + "---:|---:|" * len(keys)
    lines = [head, rule]
    for name in sorted(names, key=spread, reverse=True)[:rows]:
        cells = []
        for t in totals.values():
            calls, ms = t.ops.get(name, (0, 0.0))
            cells += [str(calls), f"{ms:.1f}"]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    cells = []
    for t in totals.values():
        cells += [str(t.calls), f"{t.self_ms:.1f}"]
    lines.append("| **all operators** | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
