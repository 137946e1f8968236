"""Registry fixtures: the folder's model (ResNet 50; the shared ``model`` is the classifier) and two versions of
the classifier with files; the upload helpers are in ``uploads.py``, the private ARTIFACT_ROOT per test is the
shared ``artifact_root``."""

from __future__ import annotations

import pytest

from apps.registry import services


@pytest.fixture
def model(owner, team, artifact_root):
    """ResNet 50 of team vision: what the upload tests upload to."""
    return services.create_model(actor=owner, team=team, name="ResNet 50", slug="resnet50")


@pytest.fixture
def v1(classifier, artifact_root):
    """Version 1 of the classifier, READY, with files."""
    from tests.registry.builders import with_files
    from tests.support.models import make_version

    return with_files(make_version(classifier, 1))


@pytest.fixture
def v2(classifier, artifact_root):
    """Version 2 of the classifier, READY, with files."""
    from tests.registry.builders import with_files
    from tests.support.models import make_version

    return with_files(make_version(classifier, 2))
