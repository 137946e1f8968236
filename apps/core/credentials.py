"""The schemes of the platform's secrets, one owner for each: the first characters of a leaked string say what it
is, and each API can refuse the others' credentials by shape before looking anything up."""

# A team's API token: ``tgp_<prefix>_<secret>`` (apps.teams).
TEAM_TOKEN_SCHEME = "tgp"
# A host's one-time join token and its standing credential: ``hjt_<secret>``, ``hag_<secret>`` (apps.fleet).
HOST_JOIN_TOKEN_SCHEME = "hjt"
HOST_CREDENTIAL_SCHEME = "hag"
HOST_SCHEMES = (HOST_JOIN_TOKEN_SCHEME, HOST_CREDENTIAL_SCHEME)
