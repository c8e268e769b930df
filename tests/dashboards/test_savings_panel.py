"""The savings panel: the deployment page shows the net saving with its sign, the measured
speed-up, checks and shadow cost and the fitted model over the page's window; without timed
tokens it says why there is no model; the overview shows the fleet's total and each
deployment's, a loss marked as one."""

from __future__ import annotations

import random
import re

from exitplane.wire import RECORDS_MSGPACK
from tests.support.batches import post_telemetry, telemetry_batch
from tests.support.costs import KnownCost, expected_savings, timed_records
from tests.support.deployments import FULL, deploy_for_telemetry


def _post(client, headers, name: str, records: list[dict]) -> None:
    answer = post_telemetry(client, headers, telemetry_batch(records, deployment=name),
                            RECORDS_MSGPACK)
    assert answer.status_code == 202, answer.text


def _net(html: str) -> str:
    return re.search(r'data-savings="net">([^<]+)<', html).group(1)


def test_deployment_and_fleet_panels(as_role, client, tokens, engine):
    cheap, dear = KnownCost(), KnownCost(check_us=400)
    saving = timed_records(random.Random(1), 150, cheap)
    losing = timed_records(random.Random(2), 150, dear, shadow_rate=0.4, exits=(3, 9, FULL))
    for name, records in (("saves", saving), ("loses", losing)):
        _post(client, deploy_for_telemetry(client, tokens, engine, name=name), name, records)
    _post(client, deploy_for_telemetry(client, tokens, engine, name="untimed"), "untimed",
          timed_records(random.Random(3), 40, cheap, timed=False))
    viewer = as_role("viewer")

    page = viewer.get("/ui/deployments/saves").text
    hours = expected_savings(saving, cheap)["net_saved_s"] / 3600
    assert _net(page) == f"{hours:+.4f} h" and hours > 0
    assert "Measured speed-up" in page and "µs per exit check" in page
    assert "net loss" not in page
    lost = viewer.get("/ui/deployments/loses").text
    assert _net(lost).startswith("-") and "net loss" in lost
    untimed = viewer.get("/ui/deployments/untimed").text
    assert 'id="savings-no-model"' in untimed and "no timed tokens" in untimed

    overview = viewer.get("/ui/").text
    rows = dict(re.findall(r'<tr data-deployment="([a-z]+)">(.*?)</tr>', overview, re.S))
    assert set(rows) == {"saves", "loses", "untimed"}
    assert "net loss" in rows["loses"] and "pays" in rows["saves"]
    assert "no cost model" in rows["untimed"]
    assert 'id="savings-total"' in overview and "340 tokens" in overview
