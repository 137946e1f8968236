"""The host agent: the program that runs on an inference host (``python -m hostagent --help``).

It holds the platform's URL and this host's credential, nothing else - no database, no broker, no Django.
It pulls the host's desired state over the agent API (``hostagent.protocol``), supervises the host's Triton + GE
instances (``supervisor``), materialises their model repositories (``repository``), loads and unloads models
(``placement``) and reports back (``reports``). Its configuration is ``hostagent.config.AgentConfig``.
"""
