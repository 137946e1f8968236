"""An uploaded version is converted: the registry announces the upload, conversions starts the job (in the
upload's transaction, so the job row and the version commit together)."""

from __future__ import annotations

from django.dispatch import receiver

from apps.conversions.services import start_conversion
from apps.registry.signals import version_uploaded


@receiver(version_uploaded, dispatch_uid="conversions.convert_uploaded_version")
def convert_uploaded_version(sender, *, actor, version, options, **kwargs) -> None:
    start_conversion(actor=actor, version=version, options=options)
