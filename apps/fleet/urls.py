from rest_framework.routers import SimpleRouter

from apps.fleet import api

router = SimpleRouter()
router.register("hosts", api.HostViewSet, basename="host")
router.register("instances", api.InstanceViewSet, basename="instance")
router.register("pools", api.PoolViewSet, basename="pool")

urlpatterns = [
    *router.urls,
]
