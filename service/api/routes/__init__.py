"""The REST routers, mounted under service.wire.API_PREFIX by service.app."""
