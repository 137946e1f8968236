import factory
from django.contrib.auth import get_user_model

from apps.teams.models import Membership, Role, Team


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.com")
    password = factory.django.Password("correct horse battery staple")


class TeamFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Team

    name = factory.Sequence(lambda n: f"Team {n}")
    slug = factory.Sequence(lambda n: f"team-{n}")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    team = factory.SubFactory(TeamFactory)
    user = factory.SubFactory(UserFactory)
    role = Role.VIEWER


def ready_onnx_version(model, onnx_bytes: bytes, scratch, *, created_by=None, **prepare_options):
    """The model's next version, READY, from ONNX bytes through the real ONNX preparation (``prepare_options``
    go to ``prepare_onnx``: batching, queue delay)."""
    from apps.registry.models import ModelVersion, SourceFormat, VersionState
    from backend_ge.convert import prepare_onnx

    number = (model.versions.order_by("-number").values_list("number", flat=True).first() or 0) + 1
    version = ModelVersion.objects.create(
        model=model,
        number=number,
        state=VersionState.CONVERTING,
        source_format=SourceFormat.ONNX,
        created_by=created_by or model.created_by,
    )
    source = scratch / f"src-{model.team.slug}-{model.slug}-{number}.onnx"
    source.write_bytes(onnx_bytes)
    version.servable_dir().parent.mkdir(parents=True, exist_ok=True)
    prepared = prepare_onnx(
        source,
        version.servable_dir() / "1",
        name=model.triton_model_name(),
        max_batch_size=8,
        **prepare_options,
    )
    version.signature = prepared.signature.to_dict()
    version.config_text = (version.servable_dir() / "config.pbtxt").read_text()
    version.state, version.toolchain = VersionState.READY, "onnx"
    version.save()
    return version
