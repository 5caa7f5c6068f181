"""Server settings, read from the environment with the prefix ``VRAMTUNE_``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
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
        "on",
        description="'on' requires an API token on every call but /health and the dashboard's "
        "pages; 'off' (every caller is an admin) is for a loopback-only demo: `vramtune serve` "
        "refuses it on another address unless given --insecure.",
    )
    allowed_hosts: str = Field(
        "localhost,127.0.0.1,::1",
        description="With auth off: the Host names the server answers (comma-separated; the "
        "address it listens on is added), so that a web page whose name is rebound to "
        "127.0.0.1 (DNS rebinding) cannot drive it. Other Host headers get a 400. Not "
        "checked with auth on, where every call needs a token.",
    )
    trusted_proxies: str = Field(
        "",
        description="Addresses of reverse proxies whose X-Forwarded-For/-Proto headers are "
        "believed (comma-separated IPs or networks; uvicorn's forwarded_allow_ips). Empty "
        "(the default): no proxy headers are read, so no caller can claim another address.",
    )
    lease_ttl_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a lease lives without a heartbeat renewing it, counted only while "
        "the server sees the database: a server that starts expires no lease for this long.",
    )
    heartbeat_interval_s: float = Field(
        5.0, gt=0, description="Seconds between worker heartbeats (told to workers)."
    )
    reaper_interval_s: float = Field(
        2.0, gt=0, description="Seconds between passes of the reaper of expired leases."
    )
    worker_stale_s: float = Field(
        30.0,
        gt=0,
        description="Seconds without a heartbeat after which a worker is stale; a server that "
        "starts ends no trial infeasible for want of a stale worker's card for this long.",
    )
    max_request_bytes: int = Field(
        MIB, ge=1024, description="Largest request body accepted; larger ones get a 413."
    )
    processes: int = Field(
        1,
        ge=1,
        le=64,
        description="Server processes sharing the port (uvicorn workers). More than one needs "
        "PostgreSQL: replicas serialize on its row locks, SQLite's writes on a process lock.",
    )
    threads: int = Field(
        8,
        ge=1,
        le=1000,
        description="Threads per server process running requests (AnyIO's default is 40). "
        "Requests are CPU-bound under one GIL: at 16 workers, 8 threads instead of 40 cut "
        "the server's CPU per trial ~12 % and p99 complete+next ~2x "
        "(bench/results/service_throughput.md).",
    )
    access_log: bool = Field(
        False,
        description="Log every HTTP request (uvicorn's access log); off by default, as it cost "
        "~10 % of the server's CPU under a fleet's calls.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="json: one JSON object per line (for log shippers); text: events as "
        "'name key=value ...'. `vramtune serve --log-format` overrides it.",
    )
    max_search_space_points: int = Field(
        100_000,
        ge=1,
        le=10**8,
        description="Largest search space a study may have where its points are enumerated: "
        "the grid sampler's grid (every parameter's values multiplied), and the combinations "
        "of a space's categorical parameters. Larger ones are refused with a 422.",
    )
    max_workers_per_token: int = Field(
        1024,
        ge=1,
        description="Workers one token may have registered. A registration past it retires "
        "(deletes) the token's oldest stopped or stale workers that hold no lease; when every "
        "one is live (heard from within worker_stale_s) or holds a lease, it gets a 429. So "
        "register/stop loops cannot grow the table.",
    )
    worker_retention_s: float = Field(
        7 * 24 * 3600.0,
        gt=0,
        le=10 * 365 * 24 * 3600.0,
        description="Seconds a stopped or stale worker's row is kept after it was last heard "
        "from; then the reaper deletes it with its ended leases (its trials keep their "
        "results). A retired worker that calls again gets a 404 and must register anew.",
    )
    max_card_bytes: int = Field(
        512 * 1024**3,
        ge=1,
        le=10**18,
        description="Largest card routing believes on a worker's word: a trial handed back waits "
        "for a larger card only if that card is within this size or its worker has measured a "
        "completed run that large; a card that claims more counts only as large as its largest "
        "measured run (512 GiB: above any GPU sold today).",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level of the server and uvicorn."
    )

    @model_validator(mode="after")
    def _one_process_on_sqlite(self) -> Settings:
        if self.processes > 1 and self.database_url.startswith("sqlite"):
            raise ValueError("processes > 1 needs PostgreSQL: SQLite's writes take a process lock")
        return self

    def as_environment(self) -> dict[str, str]:
        """These settings as ``VRAMTUNE_*`` variables, for processes that read their own."""
        return {
            f"VRAMTUNE_{name.upper()}": str(value)
            for name, value in self.model_dump(mode="json").items()
        }
