"""Traffic segments in the admin UI: the versions page shows each version's
layer x segment table, the diff shows per-segment changes, and the new-version form adds,
edits and drops segments with the API's validation messages (a refusal stores nothing)."""

from __future__ import annotations

import html
import re

import pytest
from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from controlplane.settings import Settings
from tests.support.people import csrf_of

pytestmark = pytest.mark.usefixtures("seeded")

NEW = "/ui/deployments/chat/versions/new"
MAX_SEGMENTS = 2


@pytest.fixture
def settings(db_url, tmp_path):
    """A cap of two segments, so the form can meet it with a few rows."""
    return Settings(database_url=db_url, var_dir=tmp_path / "var", config_cache_ttl_s=0.2,
                    max_segments_per_deployment=MAX_SEGMENTS)


@pytest.fixture
def segmented(engine) -> int:
    """v5: v4's default map with `code` (exits less) and `chat` maps of its own."""
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        created = thresholds.publish(
            session=session, deployment=deployment, thresholds={3: 0.85, 6: 0.8, 9: 0.65},
            segments={"code": {3: 1.0, 6: 0.95, 9: 0.9}, "chat": {3: 0.8, 6: 0.75, 9: 0.6}},
            reason="per-segment tuning", actor="user:seed")
        session.commit()
        return created.version


def _publish(client, form: dict):
    token = csrf_of(client.get(NEW).text)
    return client.post("/ui/deployments/chat/versions", data={**form, "csrf_token": token})


def _versions(engine) -> list[int]:
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        return [s.version for s in thresholds.list_threshold_sets(session=session,
                                                                  deployment=deployment)]


def _row(page: str, version: int, layer: int) -> list[str]:
    """The cells of `layer`'s row in version `version`'s layer x segment table."""
    table = re.search(rf'<tr id="v{version}".*?<table class="segment-map".*?</table>', page,
                      re.S)
    assert table, f"v{version} shows no segment table"
    row = re.search(rf'<tr><th scope="row">{layer}</th>(.*?)</tr>', table.group(0), re.S)
    assert row, f"v{version} has no row for layer {layer}"
    return re.findall(r"<td[^>]*>([^<]*)</td>", row.group(1))


def test_versions_page_shows_layer_by_segment_default_first(as_role, segmented):
    page = as_role("viewer").get("/ui/deployments/chat/versions").text
    header = re.search(r'<tr id="v5".*?<thead><tr>(.*?)</tr></thead>', page, re.S).group(1)
    assert re.findall(r'<th scope="col">([^<]+)</th>', header) == [
        "Layer", "default", "chat", "code"]
    assert _row(page, 5, 3) == ["0.850", "0.800", "never"]  # 1.0 never exits
    assert _row(page, 5, 9) == ["0.650", "0.600", "0.900"]
    # A version without segments keeps its compact one-line form.
    v4 = re.search(r'<tr id="v4".*?</tr>', page, re.S).group(0)
    assert "segment-map" not in v4 and '<span class="th ">3: 0.850</span>' in v4


def test_diff_shows_a_segment_added_changed_and_removed(as_role, engine, segmented):
    viewer = as_role("viewer")
    added = viewer.get(f"/ui/deployments/chat/diff?a=4&b={segmented}").text
    code = re.search(r'<table class="diff-table segment-diff segment-(\w+)" '
                     r'data-segment="code">(.*?)</table>', added, re.S)
    assert code and code.group(1) == "added"
    assert "added in v5 (v4 applied its default map)" in code.group(2)
    # v4 applied its default 0.85 to code's rows at layer 3; v5 gives code 1.0 (exits less).
    assert re.search(r'<th scope="row">3</th><td>0.85 <span class="muted small">\(default\)'
                     r'</span></td><td>1</td>\s*<td><span class="fewer-exits">\+0.150 '
                     r'\(exits less\)</span>', code.group(2))
    # The default map's own table is still first and unchanged between v4 and v5.
    first = re.search(r"<th scope=\"row\">3</th><td>([^<]+)</td><td>([^<]+)</td>", added)
    assert first.groups() == ("0.85", "0.85")

    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        thresholds.publish(session=session, deployment=deployment,
                           thresholds={3: 0.85, 6: 0.8, 9: 0.65},
                           segments={"code": {3: 1.0, 6: 0.9, 9: 0.9}},
                           reason="drop chat, loosen code at 6", actor="user:seed")
        session.commit()
    later = viewer.get(f"/ui/deployments/chat/diff?a={segmented}&b=6").text
    statuses = dict((name, status) for status, name in re.findall(
        r'class="diff-table segment-diff segment-(\w+)" data-segment="([^"]+)"', later))
    assert statuses == {"chat": "removed", "code": "changed"}
    assert "removed in v6 (it applies v6's default map)" in later
    assert "-0.050 (exits more)" in later  # code, layer 6: 0.95 -> 0.9

    plain = viewer.get("/ui/deployments/chat/diff?a=3&b=4").text
    assert "segment-diff" not in plain  # neither version names a segment


def test_new_version_form_starts_from_the_active_segments_and_publishes_them(
        as_role, engine, segmented):
    client = as_role("operator")
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        thresholds.move_alias(session=session, deployment=deployment, alias="active",
                              version=segmented, actor="user:seed", reason="segments")
        session.commit()
    form = client.get(NEW).text
    # The active segments (chat, code) fill the first rows; the cap (2) leaves no blank row.
    assert 'name="segment_0_name" value="chat"' in form
    assert 'name="segment_1_name" value="code"' in form
    assert 'name="segment_2_name"' not in form
    assert 'id="segment_1_layer_6" name="segment_1_layer_6" type="number" min="0" max="1" ' \
           'step="any" value="0.95"' in form

    response = _publish(client, {
        "layer_3": "0.85", "layer_6": "0.8", "layer_9": "0.65",
        "segment_0_name": "", "segment_0_layer_3": "0.8", "segment_0_layer_6": "0.75",
        "segment_0_layer_9": "0.6",  # chat dropped by clearing its name
        "segment_1_name": "code", "segment_1_layer_3": "0.99", "segment_1_layer_6": "0.95",
        "segment_1_layer_9": "0.9", "reason": "drop chat"})
    assert "Version 6 published (not active)." in response.text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        created = thresholds.get_threshold_set(session=session, deployment=deployment,
                                               version=6)
        assert created.segments_by_layer() == {"code": {3: 0.99, 6: 0.95, 9: 0.9}}
        assert created.thresholds_by_layer() == {3: 0.85, 6: 0.8, 9: 0.65}


def test_a_blank_row_is_a_copy_of_default_and_naming_it_adds_a_segment(as_role, engine):
    client = as_role("operator")
    form = client.get(NEW).text  # active v3 has no segments: two blank rows
    assert 'name="segment_0_name" value=""' in form and 'name="segment_1_name" value=""' in form
    assert 'id="segment_0_layer_3" name="segment_0_layer_3" type="number" min="0" max="1" ' \
           'step="any" value="0.9"' in form  # v3's default at layer 3
    response = _publish(client, {
        "layer_3": "0.9", "layer_6": "0.85", "layer_9": "0.7",
        "segment_0_name": "code", "segment_0_layer_3": "0.9", "segment_0_layer_6": "0.95",
        "segment_0_layer_9": "0.7",
        "segment_1_name": "", "segment_1_layer_3": "0.9", "segment_1_layer_6": "0.85",
        "segment_1_layer_9": "0.7", "reason": "code exits less at 6", "activate": "on"})
    assert "Version 5 published and active." in response.text
    page = client.get("/ui/deployments/chat/versions").text
    assert _row(page, 5, 6) == ["0.850", "0.950"]


def _api_detail(client, tokens, segments: dict) -> str:
    response = client.post("/v1/deployments/chat/threshold-sets",
                           headers=tokens.headers(tokens.operator),
                           json={"thresholds": {"3": 0.9, "6": 0.85, "9": 0.7},
                                 "segments": segments, "reason": "api"})
    assert response.status_code == 422, response.text
    return response.json()["detail"]


@pytest.mark.parametrize("rows, api_segments", [
    ({"segment_0_name": "Code Path"}, {"Code Path": {"3": 0.9, "6": 0.9, "9": 0.9}}),
    ({"segment_0_name": "default"}, {"default": {"3": 0.9, "6": 0.9, "9": 0.9}}),
    ({"segment_0_name": "code", "segment_1_name": "chat", "segment_2_name": "tools"},
     {name: {"3": 0.9, "6": 0.9, "9": 0.9} for name in ("code", "chat", "tools")}),
], ids=["bad-name", "default-name", "over-the-cap"])
def test_a_refused_segment_shows_the_api_message_in_the_form_and_stores_nothing(
        as_role, engine, client, tokens, rows, api_segments):
    before = _versions(engine)
    expected = _api_detail(client, tokens, api_segments)
    ui = as_role("operator")
    form = {"layer_3": "0.9", "layer_6": "0.85", "layer_9": "0.7", "reason": "try segments"}
    for key, name in rows.items():
        index = key.split("_")[1]
        form |= {key: name, **{f"segment_{index}_layer_{layer}": "0.9" for layer in (3, 6, 9)}}
    response = _publish(ui, form)
    assert response.status_code == 422
    error = re.search(r'<div class="flash flash-error" role="alert" id="form-error">'
                      r"Nothing was published: (.*?)</div>", response.text, re.S)
    assert error and html.unescape(error.group(1)) == expected
    # The form comes back as typed: nothing the operator entered is lost.
    for key, name in rows.items():
        assert f'name="{key}" value="{html.escape(name)}"' in response.text
    assert ">try segments</textarea>" in response.text
    assert _versions(engine) == before


def test_a_segment_named_twice_or_a_non_number_is_refused(as_role, engine):
    client = as_role("operator")
    before = _versions(engine)
    base = {"layer_3": "0.9", "layer_6": "0.85", "layer_9": "0.7", "reason": "typo"}
    twice = _publish(client, base | {
        **{f"segment_{i}_{key}": value for i in (0, 1)
           for key, value in (("name", "code"), ("layer_3", "1"), ("layer_6", "1"),
                              ("layer_9", "1"))}})
    assert twice.status_code == 422
    assert "segment &#39;code&#39; is named twice" in twice.text
    not_number = _publish(client, base | {"segment_0_name": "code", "segment_0_layer_3": "1",
                                          "segment_0_layer_6": "", "segment_0_layer_9": "1"})
    assert "segment &#39;code&#39;: threshold for layer 6 must be a number in [0, 1]" \
        in not_number.text
    out_of_range = _publish(client, base | {"segment_0_name": "code", "segment_0_layer_3": "1",
                                            "segment_0_layer_6": "1.5",
                                            "segment_0_layer_9": "1"})
    assert "segment &#39;code&#39;: threshold for layer 6 is 1.5" in out_of_range.text
    assert _versions(engine) == before


def test_confirm_and_deployment_pages_name_the_segments(as_role, engine, segmented):
    operator = as_role("operator")
    confirm = operator.get(f"/ui/deployments/chat/act/activate?version={segmented}").text
    assert 'data-segment="code"' in confirm and 'data-segment="chat"' in confirm
    assert "added in v5 (v3 applied its default map)" in confirm
    assert "own thresholds for" not in operator.get("/ui/deployments/chat").text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        thresholds.move_alias(session=session, deployment=deployment, alias="active",
                              version=segmented, actor="user:seed", reason="segments")
        session.commit()
    page = operator.get("/ui/deployments/chat").text
    assert '<span class="active-segments">own thresholds for chat, code</span>' in page
