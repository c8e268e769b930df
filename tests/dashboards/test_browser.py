"""The admin UI in a real browser: sign in with the keyboard, read a deployment's live charts,
roll a version back, and check that a viewer cannot act. Screenshots of each page at 1280 px
and 390 px land in test-artifacts/screenshots/."""

from __future__ import annotations

import random
import time

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from tests.support.browser import (
    check_page_quality,
    console_errors,
    navigate,
    screenshot,
    start_chromium,
    wait,
    wait_for,
)
from tests.support.people import PASSWORD

# slow: headless Chromium
pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture(scope="module")
def chromium():
    driver = start_chromium()
    yield driver
    driver.quit()


@pytest.fixture
def browser(chromium, live_server, people, seeded):
    chromium.delete_all_cookies()
    chromium.get_log("browser")  # drop what earlier tests left
    chromium.base = live_server.url
    yield chromium


def sign_in_with_keyboard(driver, username: str) -> None:
    driver.get(f"{driver.base}/ui/")
    wait_for(driver, "form input#username")
    # The previous test's page (polling a server now stopped) is gone: drop what it logged.
    driver.get_log("browser")
    wait(driver).until(  # autofocus (applied once the page has loaded)
        lambda d: d.switch_to.active_element.get_attribute("id") == "username")
    driver.switch_to.active_element.send_keys(username, Keys.TAB)
    assert driver.switch_to.active_element.get_attribute("id") == "password"
    driver.switch_to.active_element.send_keys(PASSWORD, Keys.ENTER)
    wait_for(driver, ".deployment-card")


def test_operator_reads_charts_and_rolls_back(browser, engine, seeded):
    driver = browser
    driver.get(f"{driver.base}/ui/login")
    wait_for(driver, "form input#username")
    check_page_quality(driver, "login")
    screenshot(driver, "login")

    sign_in_with_keyboard(driver, "operator")
    card = driver.find_element(By.CSS_SELECTOR, ".deployment-card")
    assert "chat" in card.text and "v3" in card.text
    assert "2 reporting" in card.text and "1 on v3" in card.text
    assert len(card.find_elements(By.CSS_SELECTOR, "svg.spark polyline")) == 2
    check_page_quality(driver, "overview")
    screenshot(driver, "overview")

    card.find_element(By.LINK_TEXT, "chat").click()
    wait(driver).until(lambda d: d.execute_script(
        "return document.querySelectorAll('#charts .js-plotly-plot .main-svg').length") >= 5)
    traces = driver.execute_script(
        "return document.querySelectorAll('#chart-exit_rate .scatterlayer .trace').length")
    assert traces == 3  # one line per exit layer
    bars = driver.execute_script(
        "return document.querySelectorAll('#chart-histogram .bars .point').length")
    assert bars == 4  # three exit layers and full depth
    markers = driver.execute_script(
        "return document.querySelectorAll('#chart-exit_rate .shapelayer path').length")
    assert markers >= 1  # the version changes from the audit log
    assert "%" in driver.find_element(By.CSS_SELECTOR, "[data-stat=early_exit_rate]").text
    check_page_quality(driver, "deployment")
    screenshot(driver, "deployment")

    navigate(driver, driver.find_element(By.LINK_TEXT, "Versions"))
    wait_for(driver, "table.versions")
    active_row = driver.find_element(By.CSS_SELECTOR, "tr.is-active")
    assert active_row.get_attribute("id") == "v3"
    assert "candidate" in driver.find_element(By.ID, "v4").text
    check_page_quality(driver, "versions")
    screenshot(driver, "versions")

    navigate(driver, driver.find_element(By.LINK_TEXT, "Roll back to v2"))
    reason = wait_for(driver, "textarea#reason")
    wait(driver).until(lambda d: d.switch_to.active_element == reason)  # ready to type
    assert "v3 → v2" in driver.find_element(By.ID, "confirm-title").text
    check_page_quality(driver, "rollback-confirm")
    screenshot(driver, "rollback-confirm")
    reason.send_keys("exit rate spiked after v3")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, ".reason-form button[type=submit]"))
    flash = wait_for(driver, ".flash-ok")
    assert "version 2 is active again" in flash.text
    assert driver.find_element(By.CSS_SELECTOR, "tr.is-active").get_attribute("id") == "v2"
    screenshot(driver, "versions-after-rollback")

    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        assert thresholds.aliases_of(session=session, deployment=deployment)["active"] == 2
        event = thresholds.audit_log(session=session, deployment=deployment, limit=1)[0]
    assert (event.action, event.actor, event.reason) == (
        "alias.rollback", "user:operator", "exit rate spiked after v3")

    driver.get(f"{driver.base}/ui/deployments/chat/diff?a=3&b=4")
    wait_for(driver, "table.diff-table")
    check_page_quality(driver, "diff")
    screenshot(driver, "diff")


def test_deployment_page_refreshes_itself(browser, app, engine, seeded):
    """New telemetry shows up without a reload (the page polls charts.json)."""
    from controlplane.telemetry.service import ingest
    from tests.support.dashboards import seeded_batch

    ui = next(r.app for r in app.routes if getattr(r, "path", "") == "/ui")
    ui.state.refresh_s = 1
    driver = browser
    sign_in_with_keyboard(driver, "viewer")
    # 24 h: all the seeded telemetry stays inside the window while the minutes tick.
    driver.get(f"{driver.base}/ui/deployments/chat?window=24h")
    tokens = wait_for(driver, "[data-stat=tokens]")
    before = int(tokens.text.replace(",", ""))
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        ingest(session=session, deployment=deployment, batches=[seeded_batch(
            random.Random(3), name="chat", version=3, start=time.time() - 5, n=100,
            runtime_id="rt-a", seq=999, exit_bias=0.5)])
        session.commit()
    wait(driver, 60).until(lambda d: int(d.find_element(
        By.CSS_SELECTOR, "[data-stat=tokens]").text.replace(",", "")) == before + 100)


def test_viewer_sees_but_cannot_act(browser, engine):
    driver = browser
    sign_in_with_keyboard(driver, "viewer")
    driver.get(f"{driver.base}/ui/deployments/chat/versions")
    wait_for(driver, "table.versions")
    assert driver.find_elements(By.PARTIAL_LINK_TEXT, "Roll back") == []
    assert driver.find_elements(By.CSS_SELECTOR, ".row-actions") == []
    assert driver.find_elements(By.LINK_TEXT, "Tokens") == []
    screenshot(driver, "versions-viewer")

    driver.get(f"{driver.base}/ui/deployments/chat/act/rollback?version=2")
    assert "Not allowed" in wait_for(driver, "h1").text
    screenshot(driver, "forbidden")
    # Even a hand-made POST with the viewer's own valid CSRF token is refused.
    status = driver.execute_script("""
        const token = document.querySelector('input[name=csrf_token]').value;
        const body = new URLSearchParams({csrf_token: token, reason: 'sneaky', version: '2'});
        return fetch('/ui/deployments/chat/act/rollback', {method: 'POST', body: body})
          .then(r => r.status);""")
    assert status == 403
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        assert thresholds.aliases_of(session=session, deployment=deployment)["active"] == 3


def test_operator_acknowledges_an_alert(browser, engine, firing_alert):
    from controlplane.alerts import service as alerts

    driver = browser
    sign_in_with_keyboard(driver, "operator")
    assert "1 firing" in driver.find_element(By.CSS_SELECTOR, ".deployment-card").text
    navigate(driver, driver.find_element(By.LINK_TEXT, "Alerts"))
    wait_for(driver, "table.alerts")
    check_page_quality(driver, "alerts")
    screenshot(driver, "alerts")
    navigate(driver, driver.find_element(By.PARTIAL_LINK_TEXT, "distribution_drift"))
    note = wait_for(driver, "#ack-note")
    check_page_quality(driver, "alert")
    screenshot(driver, "alert")
    note.send_keys("looking into layer 6", Keys.ENTER)  # Enter submits the form
    assert "acknowledged" in wait_for(driver, ".flash-ok").text
    assert driver.find_elements(By.ID, "ack-form") == []
    screenshot(driver, "alert-acknowledged")
    with Session(engine) as session:
        alert = alerts.get_alert(session=session, alert_id=firing_alert)
    assert (alert.status, alert.acknowledged_by) == ("acknowledged", "user:operator")

    driver.get(f"{driver.base}/ui/deployments/chat")
    wait(driver).until(lambda d: d.execute_script(
        "return document.querySelectorAll('#charts .js-plotly-plot .main-svg').length") >= 5)
    labels = driver.execute_script(
        "return Array.from(document.querySelectorAll('#chart-exit_rate .annotation-text'))"
        ".map(e => e.textContent)")
    assert "⚠ distribution_drift L6" in labels
    screenshot(driver, "deployment-with-alert")


def test_operator_approves_a_calibrated_candidate(browser, engine, calibrated):
    driver = browser
    sign_in_with_keyboard(driver, "operator")
    driver.get(f"{driver.base}/ui/deployments/chat/calibrations")
    wait_for(driver, "table.jobs")
    check_page_quality(driver, "calibrations")
    screenshot(driver, "calibrations")
    navigate(driver, driver.find_element(By.LINK_TEXT, f"#{calibrated}"))
    wait_for(driver, "#figure-curve[data-drawn]")
    stars = driver.execute_script(
        "return document.querySelectorAll('#figure-curve .scatterlayer .trace')[3]"
        ".querySelectorAll('.point').length")
    assert stars == 1  # the chosen point
    check_page_quality(driver, "calibration-job")
    screenshot(driver, "calibration-job")
    driver.find_element(By.ID, "approve-reason").send_keys("bound well under delta", Keys.ENTER)
    assert "approved: it is active" in wait_for(driver, ".flash-ok").text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        assert thresholds.aliases_of(session=session, deployment=deployment)["active"] == 5


def test_operator_adds_a_segment_and_sees_it_in_versions_and_diff(browser, engine):
    driver = browser
    sign_in_with_keyboard(driver, "operator")
    driver.get(f"{driver.base}/ui/deployments/chat/versions")
    navigate(driver, wait_for(driver, "a[href$='/versions/new']"))
    name = wait_for(driver, "input#segment_0_name")
    # A blank row starts as a copy of the active (v3) default map.
    assert driver.find_element(By.ID, "segment_0_layer_6").get_attribute("value") == "0.85"
    check_page_quality(driver, "new-version")
    screenshot(driver, "new-version")

    name.send_keys("Code")  # uppercase: refused by the service, the form comes back as typed
    layer_6 = driver.find_element(By.ID, "segment_0_layer_6")
    layer_6.clear()
    layer_6.send_keys("0.95")
    driver.find_element(By.ID, "reason").send_keys("code exits less at layer 6")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "form.stack button[type=submit]"))
    assert "segment name 'Code' is invalid" in wait_for(driver, "#form-error").text
    assert driver.find_element(By.ID, "segment_0_layer_6").get_attribute("value") == "0.95"
    # The refusal is a 422, which Chromium logs as a failed load; nothing else may be logged.
    refused = console_errors(driver)
    assert len(refused) == 1 and "status of 422" in refused[0], refused
    check_page_quality(driver, "new-version-refused")

    name = driver.find_element(By.ID, "segment_0_name")
    name.clear()
    name.send_keys("code")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "form.stack button[type=submit]"))
    assert "Version 5 published (not active)." in wait_for(driver, ".flash-ok").text
    table = driver.find_element(By.CSS_SELECTOR, "#v5 table.segment-map")
    columns = table.find_elements(By.CSS_SELECTOR, ":scope > thead th")
    assert [th.text.lower() for th in columns] == ["layer", "default", "code"]
    assert table.find_elements(By.CSS_SELECTOR, ":scope > tbody > tr")[1].text.split() == [
        "6", "0.850", "0.950"]
    check_page_quality(driver, "versions-with-segments")
    screenshot(driver, "versions-with-segments")
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        created = thresholds.get_threshold_set(session=session, deployment=deployment,
                                               version=5)
    assert created.segments_by_layer() == {"code": {3: 0.9, 6: 0.95, 9: 0.7}}

    # v5's parent link opens the diff against v3, where `code` applied the default map.
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "#v5 a[title='diff against the parent']"))
    code = wait_for(driver, "table.segment-diff[data-segment=code]")
    assert "added in v5" in code.find_element(By.TAG_NAME, "caption").text
    assert "+0.100 (exits less)" in code.text
    check_page_quality(driver, "diff-with-segments")
    screenshot(driver, "diff-with-segments")


def test_admin_manages_tokens_and_users(browser):
    driver = browser
    sign_in_with_keyboard(driver, "admin")
    navigate(driver, driver.find_element(By.LINK_TEXT, "Tokens"))
    name = wait_for(driver, "#token-name")
    name.send_keys("runtime chat-eu-1")
    driver.find_element(By.CSS_SELECTOR, "#token-scope option[value=runtime]").click()
    driver.find_element(By.CSS_SELECTOR, "#token-deployment option[value=chat]").click()
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "form.row-form button[type=submit]"))
    secret = wait_for(driver, "#new-secret").get_attribute("value")
    assert secret.startswith("ept_")
    check_page_quality(driver, "tokens-created")
    screenshot(driver, "tokens-created")
    driver.get(f"{driver.base}/ui/tokens")
    assert secret not in driver.page_source  # shown once
    navigate(driver, driver.find_element(By.CSS_SELECTOR,
                        "button[aria-label='Revoke token runtime chat-eu-1']"))
    assert "is revoked" in wait_for(driver, ".flash-ok").text
    screenshot(driver, "tokens")

    navigate(driver, driver.find_element(By.LINK_TEXT, "Users"))
    wait_for(driver, "#new-username").send_keys("dana")
    driver.find_element(By.ID, "new-password").send_keys("a long enough password")
    driver.find_element(By.CSS_SELECTOR, "#new-role option[value=operator]").click()
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "form.row-form button[type=submit]"))
    assert "'dana' created as operator" in wait_for(driver, ".flash-ok").text
    check_page_quality(driver, "users")
    screenshot(driver, "users")

    navigate(driver, driver.find_element(By.LINK_TEXT, "Hooks"))
    wait_for(driver, "#hook-name").send_keys("team slack")
    driver.find_element(By.CSS_SELECTOR, "#hook-kind option[value=slack]").click()
    driver.find_element(By.ID, "hook-url").send_keys("https://hooks.slack.com/services/T000/B000/XXXX")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "form.row-form button[type=submit]"))
    assert "team slack" in wait_for(driver, "table").text
    check_page_quality(driver, "hooks")
    screenshot(driver, "hooks")

    navigate(driver, driver.find_element(By.CSS_SELECTOR, "a.who"))
    wait_for(driver, "#current")
    check_page_quality(driver, "account")
    screenshot(driver, "account")


def test_the_contrast_check_catches_faint_text(browser):
    """The readability check above is real: faint grey on white is flagged."""
    from tests.support.browser import LOW_CONTRAST

    browser.get(f"{browser.base}/ui/login")
    wait_for(browser, "form input#username")
    assert browser.execute_script(LOW_CONTRAST) == []
    browser.execute_script("""const p = document.createElement('p');
        p.textContent = 'faint'; p.style.color = '#c8c8c8';
        document.querySelector('main').appendChild(p);""")
    assert browser.execute_script(LOW_CONTRAST) == ['P "faint" 1.57']  # on the page's #f6f8fa


def test_operator_sees_per_segment_exit_rates(browser, app, engine, seeded):
    """a deployment with traffic segments shows each segment's exit rate and
    disagreement (table and charts), and the table follows new telemetry without a reload."""
    from datetime import timedelta

    from tests.support.dashboards import CODE_ROLLUPS, add_segment_traffic, write_rollups

    now = add_segment_traffic(engine)
    ui = next(r.app for r in app.routes if getattr(r, "path", "") == "/ui")
    ui.state.refresh_s = 1
    driver = browser
    sign_in_with_keyboard(driver, "operator")
    navigate(driver, driver.find_element(By.LINK_TEXT, "chat"))
    wait(driver).until(lambda d: d.execute_script(
        "return document.querySelectorAll('#segment-charts .js-plotly-plot .main-svg').length")
        >= 2)
    names = driver.execute_script(
        "return Array.from(document.querySelectorAll('#chart-segment_exit_rate .legendtext'))"
        ".map(e => e.textContent)")
    assert names == ["default", "chat", "code"]
    rows = {row.get_attribute("data-segment"): row for row in
            driver.find_elements(By.CSS_SELECTOR, "table.segments tbody tr")}
    assert list(rows) == ["default", "chat", "code"]
    code = rows["code"].find_element(By.CSS_SELECTOR, "[data-segment-stat=exit_rate]")
    assert code.text == "10.0%"
    assert rows["chat"].find_element(By.CSS_SELECTOR, "[data-segment-stat=exit_rate]").text \
        == "60.0%"
    over = rows["code"].find_element(By.CSS_SELECTOR, "[data-segment-stat=disagreement]")
    assert over.text == "15.00%" and "text-bad" in over.get_attribute("class")
    check_page_quality(driver, "deployment-segments")
    screenshot(driver, "deployment-segments")

    # A minute where code exits at layer 3 on 90 of 100 tokens: 290 of 300 in the window...
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        write_rollups(session, deployment.id, "code",
                      now - timedelta(minutes=3),
                      {**CODE_ROLLUPS, 3: (100, 90, 40, 4, 4), 6: (10, 0, 40, 2, 2),
                       9: (10, 0, 40, 0, 0), 12: (10, 10, 40, 0, 0)})
        session.commit()
    # ... the row reads (5 + 5) * 2 + 90 = 110 early exits of 300 tokens without a reload.
    wait(driver, 60).until(lambda d: d.find_element(
        By.CSS_SELECTOR, "tr[data-segment=code] [data-segment-stat=exit_rate]").text == "36.7%")
    assert driver.find_element(
        By.CSS_SELECTOR, "tr[data-segment=code] [data-segment-stat=tokens]").text == "300"

    # The segment filter redraws the whole page's charts and totals for code alone.
    navigate(driver, driver.find_element(By.CSS_SELECTOR, "#segment-filter a[href$=code]"))
    wait(driver).until(lambda d: d.execute_script(
        "return document.querySelectorAll('#charts .js-plotly-plot .main-svg').length") >= 5)
    assert driver.find_element(By.CSS_SELECTOR, "[data-stat=tokens]").text == "300"
    assert driver.find_element(By.CSS_SELECTOR, "[data-stat=early_exit_rate]").text == "36.7%"
    assert "segment code" in driver.find_element(By.ID, "charts-title").text
    check_page_quality(driver, "deployment-segment-code")
    screenshot(driver, "deployment-segment-code")
    # Leave no page polling every second: the next test's console would show its failed
    # fetches once this test's server is gone.
    driver.get(f"{driver.base}/ui/deployments/chat/versions")


def test_operator_moves_a_set_on_the_curve_and_publishes_it(browser, engine, settings,
                                                           calibrated):
    """The deployment page draws the stored operating curve; the what-if view evaluates an
    edited set, moves its point on the curve, and publishes it with a reason."""
    from controlplane.flows.operating_curve import draw_curve

    with Session(engine) as session:
        draw_curve(session=session, settings=settings,
                   deployment=thresholds.get_deployment(session=session, name="chat"))
        session.commit()
    driver = browser
    sign_in_with_keyboard(driver, "operator")
    driver.get(f"{driver.base}/ui/deployments/chat")
    curve = wait_for(driver, "#operating-curve svg.curve")
    marks = [g.get_attribute("data-mark") for g in
             curve.find_elements(By.CSS_SELECTOR, "g.curve-mark")]
    assert {"active", "conservative", "best"} <= set(marks)
    assert "Left on the table" in driver.find_element(By.ID, "curve-gap").text
    check_page_quality(driver, "deployment-curve")
    screenshot(driver, "deployment-curve")

    navigate(driver, driver.find_element(By.ID, "what-if-link"))
    assert wait_for(driver, "#layer_3").get_attribute("value") == "0.9"  # the active v3
    check_page_quality(driver, "what-if")
    navigate(driver, driver.find_element(By.ID, "what-if-run"))
    point = wait_for(driver, "#what-if-point")
    before = (float(point.get_attribute("data-speedup")),
              driver.find_element(By.ID, "what-if-exit-rate").text)

    layer_3 = driver.find_element(By.ID, "layer_3")
    layer_3.clear()
    layer_3.send_keys("0.5")  # exit far more at the first exit layer
    navigate(driver, driver.find_element(By.ID, "what-if-run"))
    point = wait_for(driver, "#what-if-point")
    after = (float(point.get_attribute("data-speedup")),
             driver.find_element(By.ID, "what-if-exit-rate").text)
    assert after[0] > before[0] and after[1] != before[1]  # the point moved right
    assert driver.find_element(By.ID, "layer_3").get_attribute("value") == "0.5"
    check_page_quality(driver, "what-if-result")
    screenshot(driver, "what-if-result")

    driver.find_element(By.ID, "publish-reason").send_keys("what-if: layer 3 at 0.5")
    navigate(driver, driver.find_element(By.ID, "publish-run"))
    assert "Version 6 published (not active)." in wait_for(driver, ".flash-ok").text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        created = thresholds.get_threshold_set(session=session, deployment=deployment,
                                               version=6)
        event = thresholds.audit_log(session=session, deployment=deployment, limit=1)[0]
    assert created.thresholds_by_layer() == {3: 0.5, 6: 0.85, 9: 0.7}
    assert (event.action, event.actor, event.reason) == (
        "threshold_set.publish", "user:operator", "what-if: layer 3 at 0.5")
