"""Alembic migrations of vramtune's own tables (version table ``vramtune_alembic_version``)."""
