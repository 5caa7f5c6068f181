"""The REST routers, mounted under vramtune.service.wire.API_PREFIX by vramtune.service.app."""
