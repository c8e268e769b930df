"""The what-if page: an operator evaluates a threshold set on stored shadow evidence, sees its
figures and its point on the operating curve, and publishes it with a reason through the
manual-version route; bad input is a message, viewers can do none of it."""

from __future__ import annotations

import re

from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from tests.support.people import csrf_of

PAGE = "/ui/deployments/chat/what-if"
HIDDEN = re.compile(r'<input type="hidden" name="([^"]+)" value="([^"]*)">')


def _evaluate(client, **fields):
    form = {"base": "thresholds", "layer_3": "0.9", "layer_6": "0.85", "layer_9": "0.7",
            "window": "1h", "segment": "", **fields}
    return client.get(PAGE, params={**form, "run": "1"})


def _point(html: str) -> tuple[float, float]:
    match = re.search(r'id="what-if-point"[^>]*data-speedup="([\d.]+)" '
                      r'data-disagreement="([\d.]+)"', html)
    assert match, "no what-if point drawn"
    return float(match.group(1)), float(match.group(2))


def _publish_form(html: str) -> dict[str, str]:
    form = html[html.index('id="publish-form"'):]
    form = form[:form.index("</form>")]
    return dict(HIDDEN.findall(form))


def test_the_form_starts_from_the_active_set(as_role, seeded):
    page = as_role("operator").get(PAGE)
    assert page.status_code == 200
    for layer, value in ((3, "0.9"), (6, "0.85"), (9, "0.7")):  # v3, the active version
        assert f'name="layer_{layer}" inputmode="decimal" autocomplete="off" value="{value}"' \
            in page.text
    assert 'id="what-if-delta" name="delta" type="number" min="0" max="1" step="any" ' \
        'value="0.05"' in page.text
    assert "<code>rt-a</code>" in page.text and "<code>rt-b</code>" in page.text
    assert 'id="what-if-result"' not in page.text  # nothing runs until the form is sent


def test_evaluating_shows_the_figures_and_the_point(as_role, seeded):
    client = as_role("operator")
    response = _evaluate(client)
    assert response.status_code == 200, response.text
    html = response.text
    assert "the thresholds as edited" in html
    for figure in ("what-if-disagreement", "what-if-bound", "what-if-exit-rate",
                   "what-if-speedup", "what-if-saving", "what-if-depth"):
        assert f'id="{figure}"' in html
    assert re.search(r'<tr data-layer="6"><th scope="row">6</th><td>0\.850</td>', html)
    conservative = _evaluate(client, layer_3="1", layer_6="1", layer_9="1").text
    assert _point(conservative)[0] == 1.0  # nothing exits: full depth
    assert _point(html)[0] > 1.0  # v3's thresholds let tokens exit on this traffic
    assert 'id="what-if-exit-rate">0.0%' in conservative


def test_a_version_can_be_evaluated(as_role, seeded):
    html = _evaluate(as_role("operator"), base="version", version="2").text
    assert "Result <span class=\"sub\">v2" in html
    assert re.search(r'<tr data-layer="3"><th scope="row">3</th><td>0\.950</td>', html)


def test_bad_input_is_a_message_not_an_error(as_role, seeded):
    client = as_role("operator")
    word = _evaluate(client, layer_6="lots")
    assert word.status_code == 422
    assert "the threshold of layer 6 must be a number, got &#39;lots&#39;" in word.text
    assert 'value="lots"' in word.text  # the form comes back as typed
    too_big = _evaluate(client, layer_9="1.5")
    assert too_big.status_code == 422 and "lies in [0, 1]" in too_big.text
    unknown = _evaluate(client, segment="nowhere")
    assert unknown.status_code == 422 and "no traffic segment &#39;nowhere&#39;" in unknown.text
    short = _evaluate(client, base="calibration", delta="0.05", epsilon="0.1")
    assert short.status_code == 422 and "not enough shadow samples" in short.text
    assert 'id="what-if-result"' not in short.text


def test_publishing_the_evaluated_set_creates_a_version_with_a_reason(as_role, engine,
                                                                        seeded):
    client = as_role("operator")
    html = _evaluate(client, layer_6="0.8").text
    fields = _publish_form(html)
    assert (fields["layer_3"], fields["layer_6"], fields["layer_9"]) == ("0.9", "0.8", "0.7")
    no_reason = client.post("/ui/deployments/chat/versions", data={**fields, "reason": " "})
    assert "give a reason" in no_reason.text
    published = client.post("/ui/deployments/chat/versions",
                            data={**fields, "reason": "what-if: layer 6 at 0.8 stays in δ"})
    assert "Version 5 published (not active)." in published.text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        created = thresholds.get_threshold_set(session=session, deployment=deployment,
                                               version=5)
        event = thresholds.audit_log(session=session, deployment=deployment, limit=1)[0]
        active = thresholds.aliases_of(session=session, deployment=deployment)["active"]
    assert created.thresholds_by_layer() == {3: 0.9, 6: 0.8, 9: 0.7}
    assert (created.origin, created.author) == ("manual", "user:operator")
    assert (event.action, event.actor, event.reason, event.to_version) == (
        "threshold_set.publish", "user:operator", "what-if: layer 6 at 0.8 stays in δ", 5)
    assert active == 3


def test_viewers_see_no_what_if_and_cannot_publish(as_role, engine, seeded):
    viewer = as_role("viewer")
    deployment_page = viewer.get("/ui/deployments/chat").text
    assert 'id="operating-curve"' in deployment_page
    assert 'id="what-if-link"' not in deployment_page
    assert viewer.get(PAGE).status_code == 403
    run = viewer.get(PAGE, params={"run": "1", "base": "version", "version": "3"})
    assert run.status_code == 403 and 'id="what-if-result"' not in run.text
    publish = viewer.post("/ui/deployments/chat/versions", data={
        "csrf_token": csrf_of(deployment_page), "layer_3": "0.5", "layer_6": "0.5",
        "layer_9": "0.5", "reason": "sneaky"})
    assert publish.status_code == 403
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        assert len(thresholds.list_threshold_sets(session=session, deployment=deployment)) == 4


def test_publishing_needs_the_forms_csrf_token(as_role, engine, seeded):
    client = as_role("operator")
    fields = _publish_form(_evaluate(client).text)
    forged = client.post("/ui/deployments/chat/versions",
                         data={**fields, "csrf_token": "forged", "reason": "try"})
    assert forged.status_code == 403
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        assert len(thresholds.list_threshold_sets(session=session, deployment=deployment)) == 4


def test_a_segments_set_is_published_as_that_segments_map(as_role, engine, seeded):
    """Evaluated on one segment, the set replaces that segment's map; the default map and the
    other segments' maps stay the active version's."""
    from tests.support.dashboards import add_segment_traffic

    add_segment_traffic(engine)  # v5 active: default {0.9, 0.85, 0.7}, code its own map
    client = as_role("operator")
    code = client.get(PAGE, params={"segment": "code"}).text  # the curve panel's link
    assert 'name="layer_6" inputmode="decimal" autocomplete="off" value="0.97"' in code
    assert '<option value="code" selected>' in code
    html = _evaluate(client, segment="chat", layer_3="0.6").text
    assert 'id="what-if-empty"' in html  # these segments carry rollups, no shadow tokens
    fields = _publish_form(html)
    published = client.post("/ui/deployments/chat/versions",
                            data={**fields, "reason": "chat exits earlier"})
    assert "Version 6 published (not active)." in published.text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        created = thresholds.get_threshold_set(session=session, deployment=deployment,
                                               version=6)
    assert created.thresholds_by_layer() == {3: 0.9, 6: 0.85, 9: 0.7}
    assert created.segments_by_layer() == {"chat": {3: 0.6, 6: 0.85, 9: 0.7},
                                           "code": {3: 1.0, 6: 0.97, 9: 0.95}}


def test_what_calibration_would_choose_at_another_delta(as_role, calibrated):
    """A looser δ lets calibration choose a faster set; the point sits further right."""
    client = as_role("operator")
    strict = _evaluate(client, base="calibration", delta="0.01", epsilon="0.05")
    loose = _evaluate(client, base="calibration", delta="0.1", epsilon="0.05")
    assert strict.status_code == loose.status_code == 200, strict.text
    assert "what calibration would choose at δ 0.1, ε 0.05" in loose.text
    assert _point(loose.text)[0] > _point(strict.text)[0]
