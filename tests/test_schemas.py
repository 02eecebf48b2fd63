"""Payload schemas: checked at enqueue (BadInput, nothing stored), in the child (BadPayload), by the CLI."""
import dataclasses
import subprocess
import sys
import textwrap
from typing import Literal, NotRequired, TypedDict

import pytest

import supervisor
from supervisor import child, protocol, registry, schemas
from supervisor.client import Client
from supervisor.errors import BadInput


@dataclasses.dataclass
class Line:
    sku: str
    quantity: int


@dataclasses.dataclass
class Receipt:
    order_id: int
    email: str
    lines: list[Line] = dataclasses.field(default_factory=list)
    note: str | None = None
    channel: Literal["mail", "sms"] = "mail"
    amount: float = 0.0


class Refund(TypedDict):
    order_id: int
    reason: NotRequired[str]


@supervisor.job("send_receipt", payload=Receipt)
def send_receipt(ctx, payload):
    return {"kind": type(payload).__name__, "skus": [line.sku for line in payload.lines]}


@supervisor.job("refund", payload=Refund)
def refund(ctx, payload):
    return payload


@pytest.fixture
def client(sqlite_url):
    with Client.from_url(sqlite_url) as c:
        yield c


@pytest.mark.parametrize("payload, message", [
    ({"order_id": "7", "email": "a@b"}, "order_id: expected int, got str"),
    ({"order_id": True, "email": "a@b"}, "order_id: expected int, got bool"),
    ({"order_id": 7}, "email: missing (expected str)"),
    ({"order_id": 7, "email": "a@b", "colour": 1}, "colour: unknown field of Receipt"),
    ({"order_id": 7, "email": "a@b", "lines": [{"sku": "x", "quantity": 1.5}]},
     "lines[0].quantity: expected int, got float"),
    ({"order_id": 7, "email": "a@b", "note": 3}, "note: expected str | null, got int"),
    ({"order_id": 7, "email": "a@b", "channel": "fax"}, "channel: expected one of 'mail', 'sms', got 'fax'"),
    ({"order_id": 7, "email": "a@b", "amount": "1"}, "amount: expected float, got str"),
])
def test_a_bad_payload_is_refused_at_enqueue_naming_the_field(client, payload, message):
    with pytest.raises(BadInput) as err:
        send_receipt.enqueue(payload, client=client)
    assert str(err.value) == f"payload: {message}"
    assert client.stats(["default"])["default"].ready == 0


def test_a_good_payload_is_stored_as_json(client):
    job_id = send_receipt.enqueue(Receipt(7, "a@b", [Line("x", 2)]), client=client)
    plain = send_receipt.enqueue({"order_id": 8, "email": "c@d", "amount": 3}, client=client)
    assert client.get(job_id).payload == {"order_id": 7, "email": "a@b", "lines": [{"sku": "x", "quantity": 2}],
                                          "note": None, "channel": "mail", "amount": 0.0}
    assert client.get(plain).payload == {"order_id": 8, "email": "c@d", "amount": 3}


def test_typed_dicts():
    assert schemas.dump(Refund, {"order_id": 1}) == {"order_id": 1}
    with pytest.raises(BadInput, match="payload: reason: expected str, got int"):
        schemas.dump(Refund, {"order_id": 1, "reason": 2})
    with pytest.raises(BadInput, match="payload: order_id: missing"):
        schemas.dump(Refund, {})


@dataclasses.dataclass
class Shape:
    pair: tuple[int, str]
    points: tuple[int, ...] = ()


def test_tuples_are_json_lists_checked_by_position_and_loaded_as_tuples():
    assert schemas.dump(Shape, Shape((1, "a"), (2, 3))) == {"pair": [1, "a"], "points": [2, 3]}
    assert schemas.dump(Shape, {"pair": [1, "a"]}) == {"pair": [1, "a"]}
    assert schemas.load(Shape, {"pair": [1, "a"], "points": [2, 3]}) == Shape((1, "a"), (2, 3))
    with pytest.raises(BadInput, match=r"payload: pair\[1\]: expected str, got int"):
        schemas.dump(Shape, {"pair": [1, 2]})
    with pytest.raises(BadInput, match=r"payload: pair: expected a list of 2 items \(int, str\), got 3"):
        schemas.dump(Shape, {"pair": [1, "a", "b"]})
    with pytest.raises(BadInput, match=r"payload: points\[1\]: expected int, got str"):
        schemas.dump(Shape, {"pair": [1, "a"], "points": [1, "x"]})


def test_pydantic_models():
    pydantic = pytest.importorskip("pydantic")

    class Invoice(pydantic.BaseModel):
        invoice_id: int
        tags: list[str] = []

    assert schemas.dump(Invoice, Invoice(invoice_id=3)) == {"invoice_id": 3, "tags": []}
    assert schemas.load(Invoice, {"invoice_id": 3}).invoice_id == 3
    with pytest.raises(BadInput, match=r"payload: tags\.0: Input should be a valid string"):
        schemas.dump(Invoice, {"invoice_id": 3, "tags": [1]})


def test_msgspec_structs():
    msgspec = pytest.importorskip("msgspec")

    class Ping(msgspec.Struct):
        host: str
        count: int = 1

    assert schemas.dump(Ping, Ping("h")) == {"host": "h", "count": 1}
    with pytest.raises(BadInput, match="payload: Expected `int`, got `str` - at `count`"):
        schemas.dump(Ping, {"host": "h", "count": "2"})


def test_a_schema_that_is_not_one_is_refused_at_decoration():
    with pytest.raises(ValueError, match="job 'x': payload schema must be a dataclass"):
        supervisor.job("x", payload=dict)


def run(handler, payload):
    spec = registry.HandlerSpec(fn=handler.fn, **getattr(handler, registry._MARK))
    job = {"id": "job_1", "type": spec.type, "queue": "default", "payload": payload, "attempt": 1,
           "max_attempts": 3, "resource_id": None, "idempotency_key": None, "trace_id": "t", "token": 1}
    return child.run_job(job, {spec.type: spec})


def test_the_child_checks_again_and_hands_over_the_typed_object():
    ok = run(send_receipt, {"order_id": 7, "email": "a@b", "lines": [{"sku": "x", "quantity": 1}]})
    assert ok["ok"] and ok["result"] == {"kind": "Receipt", "skus": ["x"]}
    bad = run(send_receipt, {"order_id": "7", "email": "a@b"})
    assert (bad["ok"], bad["kind"], bad["error_class"]) == (False, protocol.BAD_PAYLOAD, "BadPayload")
    assert bad["message"] == "payload: order_id: expected int, got str"
    assert run(refund, {"order_id": 1})["result"] == {"order_id": 1}


HANDLER = textwrap.dedent("""
    import dataclasses
    import supervisor

    @dataclasses.dataclass
    class Receipt:
        order_id: int

    @supervisor.job("send_receipt", payload=Receipt)
    def send_receipt(ctx, payload):
        return payload.order_id
""")


@pytest.mark.parametrize("importable", [True, False])
def test_tangguh_enqueue_checks_the_handler_schema(tmp_path, importable):
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "receipts.py").write_text(HANDLER if importable else "import not_a_module_anywhere\n")
    config = tmp_path / "tangguh.toml"
    config.write_text('[supervisor]\nhandlers = "handlers"\n[broker]\nurl = "sqlite:///broker.db"\n')

    def enqueue(payload):
        return subprocess.run([sys.executable, "-m", "supervisor.cli", "enqueue", "send_receipt", "--payload",
                               payload, "-c", str(config)], capture_output=True, text=True, timeout=60)

    bad = enqueue('{"order_id": "seven"}')
    good = enqueue('{"order_id": 7}')
    assert good.returncode == 0, good.stderr
    with Client.from_url(f"sqlite:///{tmp_path}/broker.db") as client:
        ready = client.stats(["default"])["default"].ready
    if importable:
        assert (bad.returncode, bad.stderr.strip()) == (2, "tangguh: error: payload: order_id: expected int, got str")
        assert ready == 1
    else:  # the producer cannot see the handler: stored, the child checks it
        assert bad.returncode == 0 and ready == 2
