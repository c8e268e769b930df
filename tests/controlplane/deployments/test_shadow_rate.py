"""The shadow-rate decision from numbers: the smallest rate that meets every need within its
window, raised and capped by the operator's bounds, fixed by equal bounds, kept while it still
meets the needs without exceeding them by much, and the reason it gives."""

from __future__ import annotations

import pytest

from controlplane.deployments.shadow_rate import HEADROOM, ShadowNeed, decide

QUALITY = ShadowNeed("the quality drift test", 600, 600.0)


def test_stable_traffic_gets_what_the_quality_test_needs_with_headroom():
    decision = decide(shadow_rate_min=0.001, shadow_rate_max=0.5, tokens_per_s=100.0,
                      needs=[QUALITY, ShadowNeed("calibration", 1000, 86400.0)])
    wanted = HEADROOM * 600 / (100.0 * 600.0)  # 0.015
    assert wanted <= decision.rate <= wanted * 1.1
    assert "quality drift test needs 600 shadow tokens per 600 s" in decision.reason


def test_more_traffic_needs_a_lower_rate():
    rates = [decide(shadow_rate_min=0.0001, shadow_rate_max=1.0, tokens_per_s=tps,
                    needs=[QUALITY]).rate for tps in (10.0, 100.0, 1000.0)]
    assert rates[0] > rates[1] > rates[2]


def test_the_bounds_raise_and_cap_the_rate_and_say_so():
    low = decide(shadow_rate_min=0.05, shadow_rate_max=0.2, tokens_per_s=1000.0, needs=[QUALITY])
    assert low.rate == 0.05 and "raised to the bound 0.05" in low.reason
    high = decide(shadow_rate_min=0.01, shadow_rate_max=0.2, tokens_per_s=1.0, needs=[QUALITY])
    assert high.rate == 0.2 and "capped at the bound 0.2" in high.reason


def test_equal_bounds_fix_the_rate_whatever_the_traffic():
    for tps in (0.0, 1.0, 1e6):
        decision = decide(shadow_rate_min=0.07, shadow_rate_max=0.07, tokens_per_s=tps,
                          needs=[QUALITY])
        assert decision.rate == 0.07 and decision.reason == "fixed by the operator at 0.07"


def test_no_traffic_watches_the_first_tokens_at_the_maximum():
    decision = decide(shadow_rate_min=0.01, shadow_rate_max=0.2, tokens_per_s=0.0,
                      needs=[QUALITY])
    assert decision.rate == 0.2 and "no recent traffic" in decision.reason


def test_a_canary_needs_its_tokens_from_its_fraction():
    canary = ShadowNeed("the open canary", 200, 60.0, share=0.1)
    alone = decide(shadow_rate_min=0.001, shadow_rate_max=1.0, tokens_per_s=500.0,
                   needs=[QUALITY])
    with_canary = decide(shadow_rate_min=0.001, shadow_rate_max=1.0, tokens_per_s=500.0,
                         needs=[QUALITY, canary])
    assert with_canary.rate >= HEADROOM * 200 / (500.0 * 60.0 * 0.1) > alone.rate
    assert "the open canary" in with_canary.reason and "10% of the traffic" in with_canary.reason


def test_trouble_asks_the_shortest_window_for_the_same_tokens():
    stable = decide(shadow_rate_min=0.001, shadow_rate_max=1.0, tokens_per_s=100.0,
                    needs=[QUALITY])
    troubled = decide(shadow_rate_min=0.001, shadow_rate_max=1.0, tokens_per_s=100.0,
                      needs=[QUALITY, ShadowNeed("a quality_regression alert is firing: the "
                                                 "quality test's shortest window", 600, 60.0)])
    assert troubled.rate == pytest.approx(10 * stable.rate, rel=0.1)
    assert troubled.reason.startswith("a quality_regression alert is firing")


def test_a_decided_rate_is_kept_while_it_still_meets_the_needs():
    first = decide(shadow_rate_min=0.001, shadow_rate_max=1.0, tokens_per_s=100.0,
                   needs=[QUALITY])
    # A little more traffic: the rate decided still meets the need, and is not moved.
    kept = decide(shadow_rate_min=0.001, shadow_rate_max=1.0, tokens_per_s=120.0,
                  needs=[QUALITY], current=first.rate)
    assert kept.rate == first.rate
    # Much more traffic: the rate comes down; less traffic: it goes up at once.
    lower = decide(shadow_rate_min=0.001, shadow_rate_max=1.0, tokens_per_s=400.0,
                   needs=[QUALITY], current=first.rate)
    higher = decide(shadow_rate_min=0.001, shadow_rate_max=1.0, tokens_per_s=80.0,
                    needs=[QUALITY], current=first.rate)
    assert lower.rate < first.rate < higher.rate
