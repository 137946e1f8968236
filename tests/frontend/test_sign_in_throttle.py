"""Sign-in throttling (django-axes): LOGIN_FAILURE_LIMIT wrong passwords for one username, or from one address,
lock further sign-ins of that username / from that address for LOGIN_LOCKOUT_MINUTES, with a clear message on
the sign-in page. API tokens do not pass through sign-in and keep working."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.conftest import PASSWORD, bearer_client
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

LOCKED = "Too many failed sign-ins for this account or from your address: signing in is locked for 15 minutes"


def sign_in(username: str, password: str, address: str = "10.0.0.1"):
    return Client(REMOTE_ADDR=address).post("/login/", {"username": username, "password": password})


def test_five_wrong_passwords_lock_the_account_with_a_message_even_for_the_right_password(owner):
    for _ in range(4):
        response = sign_in("olivia", "wrong")
        assert response.status_code == 200 and "sign-in-locked" not in response.content.decode()
    locked = sign_in("olivia", "wrong")  # the fifth
    assert locked.status_code == 429 and LOCKED in locked.content.decode()
    # The right password from another address is refused too while the username is locked.
    refused = sign_in("olivia", PASSWORD, address="10.9.9.9")
    html = refused.content.decode()
    assert refused.status_code == 429 and 'id="sign-in-locked"' in html and 'value="olivia"' in html
    assert "sessionid" not in refused.cookies  # not signed in


def test_wrong_passwords_for_many_usernames_lock_the_address(owner, viewer):
    for name in ("a", "b", "c", "d", "e"):
        sign_in(name, "wrong", address="10.0.0.66")
    assert sign_in("vera", PASSWORD, address="10.0.0.66").status_code == 429
    # Another address signs the same user in.
    assert sign_in("vera", PASSWORD, address="10.0.0.7").status_code == 302


def test_a_successful_sign_in_starts_the_count_again(owner):
    for _ in range(4):
        sign_in("olivia", "wrong")
    assert sign_in("olivia", PASSWORD).status_code == 302
    for _ in range(4):
        assert sign_in("olivia", "wrong").status_code == 200
    assert sign_in("olivia", PASSWORD).status_code == 302


def test_the_limit_and_lockout_come_from_settings(owner, settings):
    from datetime import timedelta

    settings.AXES_FAILURE_LIMIT = 2
    settings.AXES_COOLOFF_TIME = timedelta(minutes=3)
    sign_in("olivia", "wrong")
    locked = sign_in("olivia", "wrong")
    assert locked.status_code == 429 and "locked for 3 minutes" in locked.content.decode()


def test_api_tokens_of_a_locked_user_keep_working(owner, make_token):
    _, secret = make_token()
    for _ in range(6):
        sign_in("olivia", "wrong")
    assert sign_in("olivia", PASSWORD).status_code == 429
    response = bearer_client(secret).get("/api/v1/teams/vision/")
    assert response.status_code == 200 and response.json()["slug"] == "vision"


def test_the_admin_sign_in_is_throttled_as_well(db):
    UserFactory(username="ops", is_staff=True)
    client = Client(REMOTE_ADDR="10.0.0.2")
    for _ in range(5):
        client.post("/admin/login/", {"username": "ops", "password": "wrong"})
    assert client.post("/admin/login/", {"username": "ops", "password": PASSWORD}).status_code == 429
