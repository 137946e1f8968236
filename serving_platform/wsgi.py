import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "serving_platform.settings")
application = get_wsgi_application()

# Imported after the application is set up (it uses the ORM's connection): the idle fleet's 304s skip Django.
from apps.fleet.agent_fastpath import AgentPollFastPath  # noqa: E402

application = AgentPollFastPath(application)
