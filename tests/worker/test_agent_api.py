"""The worker's REST client against a real HTTP server that answers from a script."""

from __future__ import annotations

import json
import threading
import typing
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import BaseModel

from vramtune.service.wire import (
    Assignment,
    CompleteRequest,
    FailRequest,
    HandBackRequest,
    Heartbeat,
    Measured,
    MemoryPolicy,
    NextRequest,
    Plan,
    ReportReply,
    ReportRequest,
    StartRequest,
    TrainBudget,
    WorkerRegister,
)
from vramtune.worker.loop.api import (
    LeaseLost,
    Rejected,
    ServerClient,
    ServerUnavailable,
    backoff_delays,
)

LEASE = "l" * 32
REPORT = ReportRequest(lease=LEASE, step=1, value=0.5)
COMPLETE = CompleteRequest(
    lease=LEASE, values=[0.5], plan=Plan(), measured=Measured(peak_allocated_bytes=1), duration_s=1
)
ACK = {"trial_id": 7, "resolution": "complete"}
# FastAPI's answer to a body field its model does not know (extra="forbid").
UNKNOWN_NEXT = [{"type": "extra_forbidden", "loc": ["body", "next"], "msg": "Extra inputs"}]


TOKEN = "vt_secret"


class ScriptedServer(ThreadingHTTPServer):
    """Answers each request with the next (status, body) of its script; records what came.

    A request without this test's token gets a 401, as from the real server, and is kept apart
    in `strays`: the OS may hand this server a port an earlier test's server had, while a
    worker of that test is still retrying against it (seen in CI: its heartbeat took the first
    scripted answer)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script: list[tuple[int, object]] = []
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.strays: list[tuple[str, str]] = []

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.server.strays.append((self.command, self.path))
            status, answer = 401, {"detail": "unknown token"}
        else:
            self.server.seen.append(("POST", self.path, dict(self.headers), body))
            status, answer = self.server.script.pop(0) if self.server.script else (500, None)
        payload = b"" if answer is None else json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test output is the assertions."""


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    thread = threading.Thread(target=scripted.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield scripted
    scripted.shutdown()
    scripted.server_close()


@pytest.fixture
def client(server: ScriptedServer) -> Iterator[ServerClient]:
    api = ServerClient(server.url, TOKEN, backoff_base_s=0.001, backoff_cap_s=0.01)
    yield api
    api.close()


def test_5xx_answers_are_retried_until_one_succeeds(
    server: ScriptedServer, client: ServerClient
) -> None:
    server.script = [(503, {"detail": "db"}), (500, None), (200, {"prune": True})]
    assert client.report(7, REPORT) == ReportReply(prune=True)
    assert [path for _, path, _, _ in server.seen] == ["/api/v1/trials/7/report"] * 3
    assert all(json.loads(body) == REPORT.model_dump(exclude_none=True) for *_, body in server.seen)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_4xx_answers_are_never_retried(
    server: ScriptedServer, client: ServerClient, status: int
) -> None:
    server.script = [(status, {"detail": "lease: too short"}), (200, {"prune": False})]
    with pytest.raises(Rejected) as raised:
        client.report(7, REPORT)
    assert raised.value.status_code == status
    assert raised.value.detail == "lease: too short"
    assert len(server.seen) == 1


def test_409_means_the_lease_is_lost(server: ScriptedServer, client: ServerClient) -> None:
    server.script = [(409, {"detail": "lease expired"})]
    with pytest.raises(LeaseLost, match="lease expired"):
        client.report(7, REPORT)
    assert len(server.seen) == 1


def test_the_token_is_sent_as_a_bearer(server: ScriptedServer, client: ServerClient) -> None:
    server.script = [(200, {"prune": False})]
    client.report(7, REPORT)  # a 401 (no or another token) would raise Rejected here
    headers = {k.lower(): v for k, v in server.seen[0][2].items()}
    assert headers["authorization"] == f"Bearer {TOKEN}"
    assert headers["content-type"] == "application/json"


def test_no_work_is_none_and_work_is_an_assignment(
    server: ScriptedServer, client: ServerClient
) -> None:
    assignment = Assignment(
        trial_id=3,
        number=0,
        attempt=1,
        lease=LEASE,
        lease_expires_at=datetime.now(UTC),
        study="s",
        task="quadratic",
        params={"x": 1.0},
        task_config={},
        budget=TrainBudget(),
        memory_policy=MemoryPolicy(),
        n_objectives=1,
    )
    server.script = [(204, None), (200, assignment.model_dump(mode="json"))]
    assert client.next(1, NextRequest(free_bytes=10)) is None
    assert client.next(1, NextRequest(free_bytes=10)) == assignment


def test_a_server_that_never_answers_gives_up_at_the_deadline(server: ScriptedServer) -> None:
    url = server.url
    server.shutdown()
    server.server_close()  # the port now refuses connections
    api = ServerClient(url, backoff_base_s=0.001, backoff_cap_s=0.005)
    with pytest.raises(ServerUnavailable, match="ConnectError"):
        api.report(7, REPORT, retry_for_s=0.05)


def test_cancel_ends_the_retries(server: ScriptedServer, client: ServerClient) -> None:
    cancel = threading.Event()
    cancel.set()
    server.script = [(503, None)] * 10
    with pytest.raises(ServerUnavailable, match="cancelled"):
        client.next(1, NextRequest(free_bytes=1), cancel=cancel)
    assert len(server.seen) == 1


def test_backoff_is_jittered_exponential_and_capped() -> None:
    delays = backoff_delays(0.1, 2.0)
    first = [next(delays) for _ in range(40)]
    assert all(0.0 <= d <= 2.0 for d in first)
    assert all(d <= 0.1 * 2**n for n, d in enumerate(first[:4]))
    assert len(set(first)) > 30, "jittered, not a fixed schedule"


def test_unset_optional_fields_are_left_out_of_the_body(
    server: ScriptedServer, client: ServerClient
) -> None:
    server.script = [(200, ACK)]
    client.complete(7, COMPLETE)
    sent = json.loads(server.seen[0][3])
    assert "next" not in sent and "step_time" not in sent
    assert CompleteRequest.model_validate(sent) == COMPLETE


def test_one_card_calls_carry_nothing_a_server_before_multi_gpu_trials_would_refuse() -> None:
    """Plan.world_size is left out at 1, node cards and rank needs when there are none."""
    handed_back = HandBackRequest(lease="l" * 16, min_footprint_bytes=1, plan=Plan())
    sent = json.loads(handed_back.model_dump_json(exclude_none=True))
    assert "rank_needs" not in sent and "world_size" not in sent["plan"]
    assert Plan.model_validate(sent["plan"]).world_size == 1
    two = json.loads(Plan(world_size=2, strategy="fsdp").model_dump_json(exclude_none=True))
    assert (two["world_size"], two["strategy"]) == (2, "fsdp")
    assert WorkerRegister.model_fields["cards"].default is None  # left out by exclude_none


# Every body the worker sends, and the models inside them.
WORKER_BODIES = (WorkerRegister, Heartbeat, NextRequest, StartRequest, ReportRequest)
WORKER_BODIES += (CompleteRequest, FailRequest, HandBackRequest)


def test_a_field_left_out_means_what_null_would() -> None:
    """Leaving None out is safe only while no field the worker sends defaults to another value."""
    for model in _models_within(WORKER_BODIES):
        for name, field in model.model_fields.items():
            if not field.is_required() and field.default is not None:
                assert not _accepts_none(field.annotation), f"{model.__name__}.{name}"


def test_a_complete_asking_next_goes_again_without_it_to_an_older_server(
    server: ScriptedServer, client: ServerClient
) -> None:
    asking = COMPLETE.model_copy(update={"next": NextRequest(free_bytes=10)})
    server.script = [(422, {"detail": UNKNOWN_NEXT}), (200, ACK)]
    ack = client.complete(7, asking)
    assert ack.resolution == "complete"
    first, second = (json.loads(body) for *_, body in server.seen)
    assert first["next"] == {"free_bytes": 10} and "next" not in second
    assert client.leases_on_complete is False


def test_another_422_on_a_complete_is_not_retried(
    server: ScriptedServer, client: ServerClient
) -> None:
    asking = COMPLETE.model_copy(update={"next": NextRequest(free_bytes=10)})
    refusal = [{"type": "missing", "loc": ["body", "values"], "msg": "Field required"}]
    server.script = [(422, {"detail": refusal}), (200, ACK)]
    with pytest.raises(Rejected):
        client.complete(7, asking)
    assert len(server.seen) == 1 and client.leases_on_complete is True


def _accepts_none(annotation: object) -> bool:
    return annotation is type(None) or type(None) in typing.get_args(annotation)


def _models_within(models: tuple[type[BaseModel], ...]) -> set[type[BaseModel]]:
    """The models and every model their fields hold, at any depth."""
    found: set[type[BaseModel]] = set()
    todo = list(models)
    while todo:
        model = todo.pop()
        if model in found:
            continue
        found.add(model)
        for field in model.model_fields.values():
            todo.extend(_models_in(field.annotation))
    return found


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [inner for arg in typing.get_args(annotation) for inner in _models_in(arg)]
