"""What-if: a threshold set evaluated on stored shadow evidence agrees with the truth computed
on the same tokens, bounds the disagreement as calibration does, obeys the trust rules (excluded
runtimes and each witness's share) and refuses a set that does not fit the exit layers."""

from __future__ import annotations

import json
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy.orm import Session

from controlplane.calibration.learn_then_test import clustered_risk_upper_bound
from controlplane.calibration.service import CalibrationPolicy
from controlplane.calibration.what_if import evaluate
from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import get_deployment
from controlplane.errors import Invalid
from controlplane.flows.what_if import what_if
from controlplane.runtimes.outliers import set_aside
from controlplane.stats.cost_model import CostModel
from tests.support.calibration import (
    FULL,
    LAYERS,
    make_deployment,
    policy_exit,
    separable_samples,
    write_fleet_traffic,
    write_traffic,
)

POLICY = CalibrationPolicy(min_samples_per_layer=300, seed=0)
SET = {3: 0.8, 6: 0.6, 9: 0.55}


def _truth(signals, matched, thresholds):
    """Exit rate per layer, total exit rate and disagreement of `thresholds` by hand."""
    depth = policy_exit(signals, thresholds)
    per_layer = {k: float(np.mean(depth == k)) for k in LAYERS}
    column = np.array([LAYERS.index(d) if d in LAYERS else 0 for d in depth])
    wrong = (depth < FULL) & ~matched[np.arange(len(depth)), column]
    return per_layer, float(np.mean(depth < FULL)), wrong


def _seed_fleet(engine, n=3000, seed=4, **samples):
    signals, matched = separable_samples(n, seed=seed, noise=0.05, **samples)
    with session_scope(engine) as session:
        make_deployment(session)
        write_fleet_traffic(session, "chat", signals, matched,
                            start=utcnow() - timedelta(minutes=20))
    return signals, matched


def test_a_hand_edited_set_matches_the_truth_on_the_same_tokens(engine):
    signals, matched = _seed_fleet(engine)
    with session_scope(engine) as session:
        found = what_if(session=session, deployment=get_deployment(session=session, name="chat"),
                        thresholds={str(k): v for k, v in SET.items()}, window_s=3600,
                        policy=POLICY)
    per_layer, exit_rate, wrong = _truth(signals, matched, SET)
    assert found.tokens == len(signals) and found.witnesses == 3
    assert found.exit_rate == pytest.approx(exit_rate)
    assert found.exit_rate_by_layer == pytest.approx(per_layer)
    assert found.disagreement == pytest.approx(wrong.mean())
    requests = np.array([i // 64 for i in range(len(signals))])
    bound = clustered_risk_upper_bound(np.bincount(requests, weights=wrong),
                                       np.bincount(requests), 0.1)[0]
    assert found.disagreement_bound == pytest.approx(bound, rel=1e-6)
    assert found.disagreement < found.disagreement_bound < 1.0
    # no cost model fitted: the layers ratio, and the answer says so
    assert found.cost_model is None
    assert found.speedup == pytest.approx(FULL / found.mean_depth)
    assert found.as_dict()["thresholds"] == {str(k): v for k, v in SET.items()}


def test_a_stored_version_and_a_calibration_at_another_delta(engine):
    _seed_fleet(engine)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        never = what_if(session=session, deployment=deployment, version=1, policy=POLICY)
        loose = what_if(session=session, deployment=deployment, delta=0.2, policy=POLICY)
        tight = what_if(session=session, deployment=deployment, delta=0.02, epsilon=0.2,
                        policy=POLICY)
    assert never.source == "version" and never.exit_rate == 0.0 and never.speedup == 1.0
    assert loose.source == "calibration" and tight.epsilon == 0.2
    assert loose.exit_rate > tight.exit_rate
    assert loose.disagreement > tight.disagreement


@pytest.mark.parametrize(("thresholds", "message"), [
    ({"4": 0.5}, "not an exit layer"),
    ({"3": 1.5}, "lies in [0, 1]"),
    ({"x": 0.5}, "not a layer number"),
    ({}, "at least one threshold"),
])
def test_a_hand_edited_set_that_does_not_fit_is_refused(engine, thresholds, message):
    _seed_fleet(engine, n=300)
    with session_scope(engine) as session, pytest.raises(Invalid, match=message.replace(
            "[", r"\[").replace("]", r"\]")):
        what_if(session=session, deployment=get_deployment(session=session, name="chat"),
                thresholds=thresholds, policy=POLICY)


def test_exactly_one_set_is_named(engine):
    _seed_fleet(engine, n=300)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        with pytest.raises(Invalid, match="exactly one"):
            what_if(session=session, deployment=deployment, version=1, delta=0.1)
        with pytest.raises(Invalid, match="exactly one"):
            what_if(session=session, deployment=deployment)
        with pytest.raises(Invalid, match="not enough shadow samples"):
            what_if(session=session, deployment=deployment, delta=0.1,
                    policy=CalibrationPolicy(min_samples_per_layer=10_000))


def test_excluded_runtimes_do_not_count_and_shares_are_capped(engine):
    signals, matched = separable_samples(3000, seed=5)
    start = utcnow() - timedelta(minutes=20)
    with session_scope(engine) as session:
        make_deployment(session)
        write_fleet_traffic(session, "chat", signals, matched, start=start)
        # a fourth runtime floods the window with confident tokens that never match
        write_traffic(session, "chat", np.full((6000, len(LAYERS)), 0.99, np.float32),
                      np.zeros((6000, len(LAYERS)), dtype=bool), start=start,
                      runtime_id="rt-flood")
    _, exit_rate, wrong = _truth(signals, matched, SET)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        found = what_if(session=session, deployment=deployment, thresholds=SET, policy=POLICY)
        # the flood is set aside by the outlier screen, or cut to twice the median witness's
        assert found.tokens <= 3000 + 2 * 1024 + 64
        mine = what_if(session=session, deployment=deployment, thresholds=SET,
                       runtimes=["rt-1"], policy=POLICY)
        assert 0 < mine.tokens <= 1024 and mine.witnesses == 1
        set_aside(session=session, deployment=deployment, runtime_id="rt-flood", version=0,
                  segment="default", summary="test", evidence={})
    with session_scope(engine) as session:
        cleared = what_if(session=session, deployment=get_deployment(session=session,
                                                                     name="chat"),
                          thresholds=SET, policy=POLICY)
    assert cleared.tokens == 3000 and cleared.witnesses == 3
    assert cleared.exit_rate == pytest.approx(exit_rate)
    assert cleared.disagreement == pytest.approx(wrong.mean())


def test_the_cost_model_counts_checks_and_shadow_tokens():
    signals = np.array([[0.9, 0.0, 0.0], [0.0, 0.0, 0.0]])
    matched = np.ones_like(signals, dtype=bool)
    model = CostModel(overhead_us=100.0, layer_us=10.0, check_us=15.0, num_layers=FULL,
                      tokens=1000)
    found = evaluate(signals=signals, matched=matched, thresholds={3: 0.5, 6: 1.0, 9: 1.0},
                     exit_layers=LAYERS, num_layers=FULL, delta=0.05, epsilon=0.1,
                     cost_model=model, shadow_share=0.5)
    # served: one token at depth 3 with 1 check, one at full depth with 3 checks
    served = ((100 + 30 + 15) + (100 + 120 + 45)) / 2
    shadow = 100 + 120 + 45
    per_token = 0.5 * served + 0.5 * shadow
    assert found.mean_depth == pytest.approx(7.5) and found.mean_checks == pytest.approx(2.0)
    assert found.speedup == pytest.approx(220 / per_token)
    assert found.net_saving == pytest.approx(1 - per_token / 220)
    assert found.net_saving < 0  # the checks and the shadow tokens cost more than exits save
    assert found.cost_model["check_us"] == 15.0


def test_api_what_if_and_its_refusals(client, tokens, engine):
    _seed_fleet(engine, n=1500)
    operator = tokens.headers(tokens.operator)
    path = "/v1/deployments/chat/what-if"
    answer = client.post(path, json={"thresholds": {"3": 0.8}, "window_s": 3600},
                         headers=operator)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == 1500 and body["source"] == "set" and body["cost_model"] is None
    assert body["thresholds"] == {"3": 0.8, "6": 1.0, "9": 1.0}
    wrong = client.post(path, json={"thresholds": {"5": 0.8}}, headers=operator)
    assert wrong.status_code == 422 and "not an exit layer" in wrong.text
    both = client.post(path, json={"version": 1, "delta": 0.1},
                       headers=operator)
    assert both.status_code == 422 and "exactly one" in both.text
    assert client.post(path, json={"version": 9}, headers=operator
                       ).status_code == 404
    assert client.post(path, json={"version": 1}, headers=tokens.headers("nope")
                       ).status_code == 401
    with Session(engine) as session:
        assert get_deployment(session=session, name="chat") is not None


def test_cli_what_if_over_the_api(engine, live_server, tokens, tmp_path):
    from click.testing import CliRunner

    from exitplane.cli import main

    signals, matched = _seed_fleet(engine, n=1500)
    token_file = tmp_path / "token"
    token_file.write_text(tokens.operator)
    connection = ["--url", live_server.url, "--token-file", str(token_file)]
    run = CliRunner().invoke(main, ["versions", "what-if", "chat", "--set", "3=0.8",
                                    "--set", "6=0.6", "--set", "9=0.55", "--window", "1h",
                                    "-o", "json", *connection])
    assert run.exit_code == 0, run.output
    found = json.loads(run.stdout)
    _, exit_rate, wrong = _truth(signals, matched, SET)
    assert found["exit_rate"] == pytest.approx(exit_rate)
    assert found["disagreement"] == pytest.approx(wrong.mean())
    people = CliRunner().invoke(main, ["versions", "what-if", "chat", "--version", "active",
                                       *connection])
    assert people.exit_code == 0, people.output
    assert "layers ratio" in people.stdout and "disagreement bound" in people.stdout
    refused = CliRunner().invoke(main, ["versions", "what-if", "chat", "--set", "4=0.5",
                                        *connection])
    assert refused.exit_code != 0 and "not an exit layer" in refused.output
    neither = CliRunner().invoke(main, ["versions", "what-if", "chat", *connection])
    assert neither.exit_code != 0 and "exactly one set" in neither.output


def test_a_fitted_cost_model_predicts_wall_time(engine):
    import random

    from controlplane.telemetry.service import ingest
    from exitplane.wire import TelemetryBatch
    from tests.support.batches import telemetry_batch
    from tests.support.costs import KnownCost, timed_records

    cost = KnownCost()
    records = timed_records(random.Random(3), 3000, cost, version=1, shadow_rate=0.3)
    with session_scope(engine) as session:
        deployment = make_deployment(session)
        ingest(session=session, deployment=deployment, batches=[TelemetryBatch.model_validate(
            telemetry_batch(records, deployment="chat", num_layers=FULL))])
    with session_scope(engine) as session:
        found = what_if(session=session, deployment=get_deployment(session=session, name="chat"),
                        thresholds={"3": 0.5}, window_s=86400, policy=POLICY)
    assert found.cost_model is not None
    assert found.cost_model["layer_us"] == pytest.approx(cost.layer_us, rel=0.05)
    assert found.cost_model["check_us"] == pytest.approx(cost.check_us, rel=0.1)
    assert 0.25 < found.shadow_share < 0.35
    served = cost.overhead_us + cost.layer_us * found.mean_depth + cost.check_us * \
        found.mean_checks
    shadow = cost.full_depth_us + cost.check_us * len(LAYERS)
    spent = (1 - found.shadow_share) * served + found.shadow_share * shadow
    assert found.net_saving == pytest.approx(1 - spent / cost.full_depth_us, rel=0.05)
    assert found.speedup != pytest.approx(found.layers_speedup, rel=0.01)


def test_a_what_if_gives_its_heavy_read_turn_back(client, tokens, engine):
    """A what-if is a heavy read sent as a POST: each one returns its turn, so one token's
    what-ifs in a row (one heavy read at a time per token) all run."""
    _seed_fleet(engine, n=300)
    operator = tokens.headers(tokens.operator)
    for _ in range(4):
        answer = client.post("/v1/deployments/chat/what-if", json={"version": 1},
                             headers=operator)
        assert answer.status_code == 200, answer.text
    assert client.get("/v1/deployments/chat/threshold-sets", headers=operator
                      ).status_code == 200
