"""The OpenID Connect provider of the single sign-on tests: one node process per test module."""

from __future__ import annotations

import pytest

from tests.oidc.helpers import OidcProvider, sso_settings


@pytest.fixture(scope="module")
def _module_oidc_provider(tmp_path_factory, live_server):
    provider = OidcProvider(tmp_path_factory.mktemp("oidc"), f"{live_server.url}/login/sso/callback/").start()
    yield provider
    provider.stop()


@pytest.fixture
def oidc_provider(_module_oidc_provider, settings):
    """The running provider, with single sign-on turned on against it for this test."""
    sso_settings(settings, _module_oidc_provider)
    return _module_oidc_provider
