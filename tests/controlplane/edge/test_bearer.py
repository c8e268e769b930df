"""The one bearer parser (exitplane.kit.bearer): the scheme in any case, the token stripped,
anything else (another scheme, no token, no space after the scheme) no token at all."""

from __future__ import annotations

import pytest

from exitplane.kit.bearer import bearer_token


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer ept_abc", "ept_abc"),
    ("bearer ept_abc", "ept_abc"),
    ("BEARER   ept_abc  ", "ept_abc"),
    ("Bearer ", None),
    ("Bearer", None),
    ("Bearer\tept_abc", None),
    ("Bearerept_abc", None),
    ("Basic ept_abc", None),
    ("", None),
])
def test_a_bearer_header_gives_its_token(header, token):
    assert bearer_token(header) == token
