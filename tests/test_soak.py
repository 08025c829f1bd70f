"""Soak tests: no leak over hundreds of iterations, training and then evaluation.

CI runs 40 + 40 iterations of interleaved Seq1F1B; ``SEQ1F1B_FULL=1 scripts/test.sh
tests/test_soak.py`` runs 200 + 200 for both layouts (non-interleaved and interleaved).
"""

import os

import pytest

import soak_cases
from gpt import ModelSpec

FULL = os.environ.get("SEQ1F1B_FULL") == "1"
ITERATIONS = 200 if FULL else 40
WARM = 20  # memory is compared from here: allocator pools and caches have settled
MODEL = ModelSpec(seq_length=64)
LAYOUTS = [None, 2] if FULL else [2]


@pytest.mark.parametrize("vpp", LAYOUTS, ids=[f"vpp{v}" if v else "pp2" for v in LAYOUTS])
def test_nothing_survives_an_iteration_and_memory_stays_flat(ranks, vpp):
    results = ranks.run(2, soak_cases.soak, case=f"soak-{vpp}", pp=2, k=4, vpp=vpp,
                        iterations=ITERATIONS, every=WARM, model=MODEL)
    for rank, phases in enumerate(results):
        for phase, censuses in phases.items():
            where = (rank, phase)
            for iteration, census in censuses.items():
                assert not census["alive"], (where, iteration, census["alive"])
            warm, last = censuses[WARM], censuses[ITERATIONS]
            assert last["tensors"] == warm["tensors"], (where, {i: c["tensors"] for i, c in
                                                                censuses.items()})
            growth = (last["rss_kib"] - warm["rss_kib"]) / warm["rss_kib"]
            print(f"soak {vpp=} rank {rank} {phase}: RSS {warm['rss_kib']} KiB at {WARM}, "
                  f"{last['rss_kib']} KiB at {ITERATIONS} ({growth:+.3%}), "
                  f"{last['tensors']} live tensors")
            assert growth < 0.01, (where, {i: c["rss_kib"] for i, c in censuses.items()})
