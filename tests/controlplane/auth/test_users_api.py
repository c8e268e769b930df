"""/v1/users (admin): users are listed without their password hashes, created with a role and
a checked password, re-roled, disabled and enabled, given a new password that signs in while
the old one no longer does; a duplicate is 409, a bad role or a short password 422, an unknown
user 404, and the last enabled admin can be neither demoted nor disabled (409). Each change is
an audit event."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from controlplane.auth.models import AdminEvent
from controlplane.auth.users import authenticate_user
from controlplane.db import session_scope
from controlplane.errors import Unauthorized

pytestmark = pytest.mark.usefixtures("quick_hashing")

PASSWORD = "correct horse battery staple"


def test_users_over_the_api(client, tokens, engine):
    admin = tokens.headers(tokens.admin)
    made = client.post("/v1/users", headers=admin,
                       json={"username": "Ana", "role": "operator", "password": PASSWORD})
    assert made.status_code == 201, made.text
    assert made.json()["username"] == "ana" and "password_hash" not in made.json()
    assert client.post("/v1/users", headers=admin, json={
        "username": "ana", "role": "viewer", "password": PASSWORD}).status_code == 409
    for bad in ({"username": "bo", "role": "root", "password": PASSWORD},
                {"username": "bo", "role": "viewer", "password": "short"},
                {"username": "Not A Name", "role": "viewer", "password": PASSWORD}):
        assert client.post("/v1/users", headers=admin, json=bad).status_code == 422, bad
    assert [u["username"] for u in client.get("/v1/users", headers=admin).json()] == ["ana"]
    assert client.get("/v1/users/ANA", headers=admin).json()["role"] == "operator"
    assert client.get("/v1/users/nobody", headers=admin).status_code == 404

    changed = client.patch("/v1/users/ana", headers=admin,
                           json={"role": "viewer", "password": PASSWORD + "!"})
    assert changed.status_code == 200 and changed.json()["role"] == "viewer"
    with session_scope(engine) as session:
        assert authenticate_user(session=session, username="ana",
                                 password=PASSWORD + "!").username == "ana"
        with pytest.raises(Unauthorized):
            authenticate_user(session=session, username="ana", password=PASSWORD)
    assert client.patch("/v1/users/ana", headers=admin,
                        json={"disabled": True}).json()["disabled"] is True
    assert client.patch("/v1/users/ana", headers=admin,
                        json={"disabled": False}).json()["disabled"] is False
    with session_scope(engine) as session:
        actions = [e.action for e in session.scalars(select(AdminEvent).where(
            AdminEvent.target == "user:ana").order_by(AdminEvent.id))]
    assert actions == ["user.create", "user.role", "user.password", "user.disable",
                       "user.enable"]


def test_the_last_admin_stays(client, tokens):
    admin = tokens.headers(tokens.admin)
    assert client.post("/v1/users", headers=admin, json={
        "username": "root", "role": "admin", "password": PASSWORD}).status_code == 201
    for change in ({"role": "viewer"}, {"disabled": True}):
        refused = client.patch("/v1/users/root", headers=admin, json=change)
        assert refused.status_code == 409, refused.text
        assert "last enabled admin" in refused.json()["detail"]
    assert client.get("/v1/users", headers=tokens.headers(tokens.operator)).status_code == 403
