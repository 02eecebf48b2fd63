"""Payload schemas: checked at enqueue (BadInput, nothing stored), in the child (BadPayload), by the CLI."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from typing import Literal, NewType, NotRequired, TypedDict

import pytest

import supervisor
from supervisor import child, protocol, registry, schemas
from supervisor.client import Client
from supervisor.errors import BadInput
from supervisor.schemas import SchemaError

from .daemon import Daemon


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


def test_typed_dict_keys_marked_not_required_under_postponed_annotations(tmp_path):
    """With `from __future__ import annotations` (Python 3.11 reads the marks in strings wrong),
    a NotRequired key was required ("reason: missing") and a Required key of a total=False
    TypedDict was optional: payloads the schema declares valid were refused, and invalid ones let in."""
    (tmp_path / "refunds.py").write_text(textwrap.dedent("""
        from __future__ import annotations
        from typing import NotRequired, Required, TypedDict
        import supervisor

        class Refund(TypedDict):
            order_id: int
            reason: NotRequired[str]

        class Partial(TypedDict, total=False):
            order_id: Required[int]
            amount: float

        class Wider(Refund, total=False):
            note: str

        @supervisor.job("refund", payload=Refund)
        def refund(ctx, payload):
            return payload

        @supervisor.job("partial", payload=Partial)
        def partial(ctx, payload):
            return payload

        @supervisor.job("wider", payload=Wider)
        def wider(ctx, payload):
            return payload
    """))
    specs = registry.load_handlers(str(tmp_path))
    refund, partial, wider = (specs[t].payload for t in ("refund", "partial", "wider"))
    assert schemas.dump(refund, {"order_id": 1}) == {"order_id": 1}
    assert schemas.load(refund, {"order_id": 1}) == {"order_id": 1}
    assert schemas.dump(partial, {"order_id": 1}) == {"order_id": 1}
    with pytest.raises(BadInput, match="payload: order_id: missing"):
        schemas.dump(partial, {"amount": 1.5})
    assert schemas.dump(wider, {"order_id": 1}) == {"order_id": 1}
    with pytest.raises(BadInput, match="payload: order_id: missing"):
        schemas.dump(wider, {"note": "x"})


def test_an_annotation_only_a_type_checker_can_resolve_is_accepted_as_it_comes(tmp_path, client):
    """A field annotated with a name imported under `if TYPE_CHECKING:` made every check raise
    NameError: a traceback at enqueue, and in the child an exception retried to dead. An
    annotation the checker does not know is accepted as it comes; the other fields are checked."""
    (tmp_path / "payments.py").write_text(textwrap.dedent("""
        from __future__ import annotations
        import dataclasses
        from typing import TYPE_CHECKING, NotRequired, TypedDict
        import supervisor
        if TYPE_CHECKING:
            from decimal import Decimal

        @dataclasses.dataclass
        class Payment:
            amount: Decimal
            order_id: int

        class Refund(TypedDict):
            amount: Decimal
            reason: NotRequired[str]

        @supervisor.job("pay", payload=Payment)
        def pay(ctx, payment):
            return {"amount": payment.amount, "order_id": payment.order_id}

        @supervisor.job("refund", payload=Refund)
        def refund(ctx, payload):
            return payload
    """))
    specs = registry.load_handlers(str(tmp_path))
    payment, refund = specs["pay"].payload, specs["refund"].payload
    job_id = supervisor.JobRef("pay", payload=payment).enqueue({"amount": "9.99", "order_id": 7}, client=client)
    assert schemas.for_handler(specs["pay"], client.get(job_id).payload) == payment("9.99", 7)
    with pytest.raises(BadInput, match="payload: order_id: expected int, got str"):
        schemas.dump(payment, {"amount": "9.99", "order_id": "7"})
    assert schemas.dump(refund, {"amount": "1"}) == {"amount": "1"}
    with pytest.raises(BadInput, match="payload: reason: expected str, got int"):
        schemas.dump(refund, {"amount": "1", "reason": 2})


@dataclasses.dataclass
class Priced:
    cents: int
    currency: dataclasses.InitVar[str]
    rate: dataclasses.InitVar[float] = 1.0

    def __post_init__(self, currency, rate):
        self.cents = round(self.cents * rate)
        self.label = f"{self.cents} {currency}"


def test_a_dataclass_init_var_is_a_payload_field_its_constructor_takes(client):
    """An InitVar is an argument of the constructor, so of the payload; it was refused as an
    "unknown field" (and a required one as missing from the constructor): no payload matched."""
    job_id = supervisor.JobRef("price", payload=Priced).enqueue({"cents": 100, "currency": "EUR", "rate": 1.5},
                                                                client=client)
    priced = schemas.load(Priced, client.get(job_id).payload)
    assert (priced.cents, priced.label) == (150, "150 EUR")
    with pytest.raises(BadInput, match="payload: currency: missing"):
        schemas.dump(Priced, {"cents": 100})
    with pytest.raises(BadInput, match="payload: rate: expected float, got str"):
        schemas.dump(Priced, {"cents": 100, "currency": "EUR", "rate": "x"})


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


def test_a_pydantic_model_with_field_aliases_enqueued_as_an_instance():
    """model_dump wrote field names and model_validate wanted the aliases: a valid instance was
    refused ("orderId: Field required") where the same payload as a dict passed."""
    pydantic = pytest.importorskip("pydantic")

    class Order(pydantic.BaseModel):
        order_id: int = pydantic.Field(alias="orderId")

    class Shown(pydantic.BaseModel):  # an alias for output only: read back by the field's name
        order_id: int = pydantic.Field(serialization_alias="orderId")

    class Camel(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(alias_generator=pydantic.AliasGenerator(
            serialization_alias=lambda name: name.upper()))
        order_id: int

    assert schemas.dump(Order, Order(orderId=7)) == {"orderId": 7}
    assert schemas.load(Order, schemas.dump(Order, Order(orderId=7))).order_id == 7
    for model in (Shown, Camel):
        assert schemas.dump(model, model(order_id=7)) == {"order_id": 7}
        assert schemas.load(model, schemas.dump(model, model(order_id=7))).order_id == 7


def test_set_fields_are_json_lists_and_sets_again_in_the_handler():
    """A set field's instance was refused ("expected a list, got set"), and a payload's list
    reached the handler as a list."""
    @dataclasses.dataclass
    class Tagged:
        tags: set[int]
        kinds: frozenset[str] = frozenset()

    assert schemas.dump(Tagged, Tagged({3, 1, 2}, frozenset({"b", "a"}))) == {"tags": [1, 2, 3], "kinds": ["a", "b"]}
    loaded = schemas.load(Tagged, {"tags": [2, 1, 2], "kinds": ["a"]})
    assert (loaded.tags, loaded.kinds) == ({1, 2}, frozenset({"a"}))
    with pytest.raises(BadInput, match=r"payload: tags\[0\]: expected int, got str"):
        schemas.dump(Tagged, {"tags": ["x"]})

    @dataclasses.dataclass
    class Nested:
        groups: set[list[int]]  # no set can hold a list: refused as the payload's fault, not a crash

    with pytest.raises(SchemaError, match="groups: items of a set must be hashable"):
        schemas.load(Nested, {"groups": [[1]]})


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


def test_tangguh_enqueue_sends_a_job_to_its_decorators_queue_as_enqueue_does(tmp_path):
    """`tangguh enqueue` imported the handlers for their schemas only: a type decorated
    queue="receipts" went to `default`, where Handler.enqueue() sends it to `receipts`."""
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "receipts.py").write_text(HANDLER.replace("payload=Receipt)", 'payload=Receipt, queue="receipts")'))
    config = tmp_path / "tangguh.toml"
    config.write_text('[supervisor]\nhandlers = "handlers"\n[broker]\nurl = "sqlite:///broker.db"\n'
                      'queues = ["default", "receipts"]\n')
    done = subprocess.run([sys.executable, "-m", "supervisor.cli", "enqueue", "send_receipt", "--payload",
                           '{"order_id": 7}', "-c", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    with Client.from_url(f"sqlite:///{tmp_path}/broker.db") as client:
        assert client.get(done.stdout.strip()).queue == "receipts"


@dataclasses.dataclass
class Order:
    order_id: int
    lines: list[Line] = dataclasses.field(default_factory=list)
    total: int = dataclasses.field(init=False, default=0)  # the class computes it

    def __post_init__(self):
        if self.order_id < 0:
            raise ValueError("order_id must be >= 0")
        self.total = sum(line.quantity for line in self.lines)


@supervisor.job("place_order", payload=Order)
def place_order(ctx, order):
    return {"total": order.total}


def test_a_dataclass_with_an_init_false_field_is_stored_without_it_and_rebuilt(client):
    job_id = place_order.enqueue(Order(7, [Line("x", 2), Line("y", 3)]), client=client)
    stored = client.get(job_id).payload
    assert stored == {"order_id": 7, "lines": [{"sku": "x", "quantity": 2}, {"sku": "y", "quantity": 3}]}
    assert run(place_order, stored)["result"] == {"total": 5}
    with pytest.raises(BadInput, match=r"^payload: total: not an init field of Order"):
        place_order.enqueue({"order_id": 7, "total": 9}, client=client)
    assert client.stats(["default"])["default"].ready == 1


@dataclasses.dataclass
class Positive:
    amount: int

    def __post_init__(self):
        if self.amount < 0:
            raise ValueError("amount must be >= 0")
        if self.amount > 1000:
            raise TypeError("amount over 1000")


@dataclasses.dataclass
class Transfer:
    parts: list[Positive]


@pytest.mark.parametrize("schema, payload, message", [
    (Order, {"order_id": -1}, "Order refused it: ValueError: order_id must be >= 0"),
    (Positive, {"amount": 1001}, "Positive refused it: TypeError: amount over 1000"),
    (Transfer, {"parts": [{"amount": 1}, {"amount": -1}]},
     "parts[1]: Positive refused it: ValueError: amount must be >= 0"),
])
def test_a_schema_that_refuses_its_values_is_bad_input_at_enqueue_and_bad_payload_in_the_child(
        client, schema, payload, message):
    with pytest.raises(BadInput) as err:
        supervisor.JobRef("checked", payload=schema).enqueue(payload, client=client)
    assert str(err.value) == f"payload: {message}"
    assert client.stats(["default"])["default"].ready == 0
    handler = supervisor.job("checked", payload=schema)(lambda ctx, p: None)
    bad = run(handler, payload)
    assert (bad["ok"], bad["kind"], bad["error_class"]) == (False, protocol.BAD_PAYLOAD, "BadPayload")
    assert bad["message"] == f"payload: {message}"


def test_pydantic_and_msgspec_code_that_refuses_its_values_is_bad_input():
    pydantic = pytest.importorskip("pydantic")
    msgspec = pytest.importorskip("msgspec")

    class Invoice(pydantic.BaseModel):
        invoice_id: int

        @pydantic.field_validator("invoice_id")
        @classmethod
        def known(cls, value):
            if value == 0:
                raise TypeError("invoice 0 does not exist")  # pydantic passes a TypeError through
            return value

    class Ping(msgspec.Struct):
        count: int

        def __post_init__(self):
            if self.count < 1:
                raise ValueError("count must be >= 1")

    with pytest.raises(BadInput, match="^payload: Invoice refused it: TypeError: invoice 0 does not exist$"):
        schemas.dump(Invoice, {"invoice_id": 0})
    with pytest.raises(BadInput, match="^payload: count must be >= 1$"):
        schemas.dump(Ping, {"count": 0})


def test_pydantic_and_msgspec_store_int_keys_as_json_strings_and_load_them_back():
    pydantic = pytest.importorskip("pydantic")
    msgspec = pytest.importorskip("msgspec")

    class Model(pydantic.BaseModel):
        by_id: dict[int, str]

    class Struct(msgspec.Struct):
        by_id: dict[int, str]

    for schema in (Model, Struct):
        stored = schemas.dump(schema, schema(by_id={1: "a"}))
        assert stored == {"by_id": {"1": "a"}}
        assert schemas.load(schema, stored).by_id == {1: "a"}


@dataclasses.dataclass
class Level:
    level: Literal[1, 2]


@pytest.mark.parametrize("value", [True, 1.0, "1"])
def test_a_literal_compares_types_too(value):
    assert schemas.dump(Level, {"level": 1}) == {"level": 1}
    with pytest.raises(BadInput, match=f"^payload: level: expected one of 1, 2, got {value!r}$"):
        schemas.dump(Level, {"level": value})


@dataclasses.dataclass
class Names:
    by_id: dict[int, str]


@pytest.mark.parametrize("payload, message", [
    ({1: "a", "1": "b"}, "payload: the key 1 is int, not a string"),
    ({"m": {"1": "b", 1: "a"}}, "payload.m: the key 1 is int, not a string"),
    ({"m": [{"ok": 1}, {None: 2}]}, "payload.m[1]: the key None is NoneType, not a string"),
    ({"m": {(1, 2): 3}}, "payload.m: the key (1, 2) is tuple, not a string"),
])
def test_a_non_string_key_is_refused_naming_its_path_not_converted(client, payload, message):
    with pytest.raises(BadInput) as err:
        client.enqueue("t", payload)
    assert str(err.value) == f"{message} (JSON object keys are strings)"
    with pytest.raises(BadInput, match=r"^payload\.by_id: the key 1 is int, not a string"):
        supervisor.JobRef("names", payload=Names).enqueue(Names({1: "a"}), client=client)
    assert client.stats(["default"])["default"].ready == 0


@supervisor.job("int_keys")
def int_keys(ctx, payload):
    return {"by_id": {1: "a", "1": "b"}}


def test_a_result_with_a_non_string_key_fails_its_attempt_saying_where():
    reply = run(int_keys, {})
    assert (reply["ok"], reply["kind"], reply["error_class"]) == (False, protocol.EXCEPTION, "BadInput")
    assert reply["message"] == "handler result.by_id: the key 1 is int, not a string (JSON object keys are strings)"


def test_a_client_enqueue_or_workflow_step_given_the_handler_checks_its_schema(client):
    """client.chain([(send_receipt, ...)]) was refused ("job type must be a non-empty string"), so
    a workflow named its steps by string and no step's payload was checked at enqueue: a bad one
    was stored and found in the child (bad_payload) after the steps before it had run."""
    with pytest.raises(BadInput, match=r"^chain step 1: payload: order_id: expected int, got str$"):
        client.chain([(send_receipt, Receipt(7, "a@b")), (send_receipt, {"order_id": "8", "email": "c@d"})])
    assert client.stats(["default"])["default"].ready == 0
    first, second = client.chain([(send_receipt, Receipt(7, "a@b")), (refund, {"order_id": 7})])
    assert [(j.type, j.payload["order_id"]) for j in map(client.get, (first, second))] == [
        ("send_receipt", 7), ("refund", 7)]
    assert client.get(client.enqueue(refund, {"order_id": 8})).type == "refund"
    with pytest.raises(BadInput, match="^payload: reason: expected str, got int$"):
        client.enqueue(refund, {"order_id": 8, "reason": 1})


OrderId = NewType("OrderId", int)


@dataclasses.dataclass
class Shipment:
    order_id: OrderId
    tracking: list[OrderId] = dataclasses.field(default_factory=list)


def test_a_new_type_is_checked_as_the_type_it_names():
    """`OrderId = NewType("OrderId", int)` was an annotation the checker did not know: a payload
    with "order_id": "7" was stored, and the handler got a str where its schema says an int."""
    assert schemas.dump(Shipment, {"order_id": 7, "tracking": [1]}) == {"order_id": 7, "tracking": [1]}
    with pytest.raises(BadInput, match="^payload: order_id: expected int, got str$"):
        schemas.dump(Shipment, {"order_id": "7"})
    with pytest.raises(SchemaError, match=r"^tracking\[0\]: expected int, got bool$"):
        schemas.load(Shipment, {"order_id": 7, "tracking": [True]})


def test_a_stored_payload_may_hold_fields_the_schema_dropped_since_it_was_enqueued():
    """A release that drops a field (a rolling deploy): jobs enqueued before it still carry the
    key. The producer's check refuses an unknown key (a typo); the child leaves it out, as pydantic
    and msgspec do, instead of dead-lettering every job queued under the old release."""
    old = {"order_id": 7, "email": "a@b", "retired": 1, "lines": [{"sku": "x", "quantity": 1, "bin": "A4"}]}
    assert run(send_receipt, old)["result"] == {"kind": "Receipt", "skus": ["x"]}
    assert run(refund, {"order_id": 1, "retired": True})["result"] == {"order_id": 1}
    with pytest.raises(BadInput, match="retired: unknown field of Receipt"):
        schemas.dump(Receipt, old)
    bad = run(send_receipt, {"order_id": 7, "email": 3, "retired": 1})  # a known field still checked
    assert (bad["kind"], bad["message"]) == (protocol.BAD_PAYLOAD, "payload: email: expected str, got int")


def test_a_float_field_given_a_json_integer_hands_the_handler_a_float():
    @supervisor.job("amount_type", payload=Receipt)
    def amount_type(ctx, payload):
        return type(payload.amount).__name__

    assert run(amount_type, {"order_id": 7, "email": "a@b", "amount": 2})["result"] == "float"
    assert schemas.dump(Receipt, {"order_id": 7, "email": "a@b", "amount": 2})["amount"] == 2  # stored as sent
    with pytest.raises(SchemaError, match=r"amount: 1{400} is too large for a float"):
        schemas.load(Receipt, {"order_id": 7, "email": "a@b", "amount": int("1" * 400)})


DEPLOYED = textwrap.dedent("""
    import dataclasses
    import supervisor

    @dataclasses.dataclass
    class Receipt:
        order_id: int{field}

    @supervisor.job("deployed_receipt", payload=Receipt)
    def deployed_receipt(ctx, payload):
        return payload.order_id
""")


def test_jobs_queued_before_a_release_dropped_a_field_run_after_it(tmp_path):
    """The real daemon: a job stored by the old release's schema (with ``channel``), then the
    handler module without that field, then ``tangguh run``: the job is done, not dead."""
    d = Daemon(tmp_path, handler_files=())
    with open(os.path.join(d.handlers, "deployed.py"), "w") as f:
        f.write(DEPLOYED.format(field="\n    channel: str = 'mail'"))
    importing = subprocess.run([sys.executable, "-c", "import deployed, json; print(json.dumps(deployed.Receipt"
                                "(7, 'sms').__dict__))"], cwd=d.handlers, capture_output=True, text=True, timeout=60)
    job_id = d.enqueue("deployed_receipt", json.loads(importing.stdout))  # what the old producer stored
    with open(os.path.join(d.handlers, "deployed.py"), "w") as f:
        f.write(DEPLOYED.format(field=""))
    d.start()
    try:
        job = d.wait_job(job_id)
        assert (job.state, job.result, job.payload) == ("done", 7, {"order_id": 7, "channel": "sms"})
        d.assert_clean()
    finally:
        d.stop()
