"""Sign-in pages: the sign-in form with its "Sign in with <provider>" button, and single sign-on's two steps
(to the identity provider, and back), on mozilla-django-oidc's views. Every refusal is a page that says why."""

from __future__ import annotations

import requests
from django.conf import settings
from django.contrib.auth import views as auth_views
from django.core.exceptions import SuspiciousOperation
from django.http import Http404
from django.shortcuts import render
from django.views.generic import View
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from apps.teams.oidc import SsoError, provider_metadata


def sso_error(request, message: str, status: int = 400):
    return render(request, "registration/sso_error.html", {"message": message}, status=status)


def sign_in_context() -> dict:
    """What the sign-in page shows besides its form: the provider's button, the password form or not."""
    return {
        "sso_enabled": settings.OIDC_ENABLED,
        "sso_name": settings.OIDC_PROVIDER_NAME,
        "local_sign_in": settings.LOCAL_SIGN_IN,
    }


class SignInView(auth_views.LoginView):
    redirect_authenticated_user = True

    def get_context_data(self, **kwargs):
        return {**super().get_context_data(**kwargs), **sign_in_context()}

    def post(self, request, *args, **kwargs):
        if not settings.LOCAL_SIGN_IN:
            return sso_error(
                request, f"Passwords are turned off here: sign in with {settings.OIDC_PROVIDER_NAME}.", 403
            )
        return super().post(request, *args, **kwargs)


class SsoStartView(OIDCAuthenticationRequestView):
    """Redirects to the provider with state, nonce and a PKCE challenge (kept in the session)."""

    def __init__(self, **kwargs):
        # Not the library's __init__, which reads the endpoint from settings: it comes from discovery here.
        View.__init__(self, **kwargs)
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID

    def get(self, request):
        if not settings.OIDC_ENABLED:
            raise Http404("Single sign-on is not configured.")
        try:
            self.OIDC_OP_AUTH_ENDPOINT = provider_metadata()["authorization_endpoint"]
        except SsoError as exc:
            return sso_error(request, exc.message, exc.status)
        return super().get(request)


class SsoCallbackView(OIDCAuthenticationCallbackView):
    """Where the provider sends the browser back: the state must be one this browser's session started."""

    def get(self, request):
        if not settings.OIDC_ENABLED:
            raise Http404("Single sign-on is not configured.")
        started = request.session.get("oidc_states")
        state = request.GET.get("state")
        if request.GET.get("error"):
            super().get(request)  # forgets the state, so the answer cannot be replayed
            description = request.GET.get("error_description") or request.GET["error"]
            return sso_error(request, f"The identity provider did not sign you in: {description}")
        if not request.GET.get("code") or not state:
            return sso_error(
                request, "The identity provider's answer lacks its code or state. Sign in again."
            )
        if not isinstance(started, dict) or state not in started:
            return sso_error(
                request,
                "This sign-in answer does not belong to a sign-in started in this browser (its state does not "
                "match, or it was already used). Start again from the sign-in page.",
            )
        try:
            return super().get(request)
        except SsoError as exc:
            return sso_error(request, exc.message, exc.status)
        except requests.RequestException as exc:
            detail = exc.response.text[:300] if exc.response is not None else str(exc)
            return sso_error(request, f"The identity provider refused the sign-in: {detail}", 502)
        except SuspiciousOperation as exc:
            return sso_error(request, f"The sign-in was refused: {exc}")

    def login_failure(self):
        user = getattr(self, "user", None)
        if user is not None and not user.is_active:
            return sso_error(self.request, "This account is disabled on the platform.", 403)
        return sso_error(
            self.request, "The sign-in could not be completed. Start again from the sign-in page."
        )
