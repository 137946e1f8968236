"""The platform's command-line client (``tgp``) and the small client library it is built on
(``tgp.client``). Django-free: it speaks to the platform over HTTP only."""
