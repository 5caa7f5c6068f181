"""Server settings, read from the environment with the prefix ``VRAMTUNE_``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MIB = 1024 * 1024


class Settings(BaseSettings):
    """Everything the server can be told; each field is also ``VRAMTUNE_<NAME>`` in the env."""

    model_config = SettingsConfigDict(env_prefix="VRAMTUNE_", extra="ignore")

    database_url: str = Field(
        "sqlite:///./vramtune.db",
        description="SQLAlchemy URL of the database: sqlite:///FILE or postgresql+psycopg://...",
    )
    host: str = Field("127.0.0.1", description="Interface the server listens on.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port the server listens on.")
    auth: Literal["on", "off"] = Field(
        "off", description="'on' requires an API token on every call but /health."
    )
    lease_ttl_s: float = Field(
        30.0, gt=0, description="Seconds a lease lives without a heartbeat renewing it."
    )
    heartbeat_interval_s: float = Field(
        5.0, gt=0, description="Seconds between worker heartbeats (told to workers)."
    )
    reaper_interval_s: float = Field(
        2.0, gt=0, description="Seconds between passes of the reaper of expired leases."
    )
    worker_stale_s: float = Field(
        30.0, gt=0, description="Seconds without a heartbeat after which a worker is stale."
    )
    max_request_bytes: int = Field(
        MIB, ge=1024, description="Largest request body accepted; larger ones get a 413."
    )
    access_log: bool = Field(
        False,
        description="Log every HTTP request (uvicorn's access log); off by default, as it cost "
        "~10 % of the server's CPU under a fleet's calls.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level of the server and uvicorn."
    )
