"""Entry points: the HTTP server (FastAPI) and the offline :class:`Engine`."""
