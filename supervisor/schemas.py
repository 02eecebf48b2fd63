"""Payload schemas: a handler's payload type, checked on both sides of the queue.

``@supervisor.job("send_receipt", payload=Receipt)`` where ``Receipt`` is a
dataclass, a ``TypedDict``, a pydantic model or a msgspec ``Struct`` (the last
two only when the application has them installed: Tangguh does not depend on
either). The producer's payload is checked by ``dump`` (``BadInput`` naming the
field and the expected type, nothing stored); the child checks the stored
payload again with ``load`` (``BadPayload``: dead at once, never retried) and
hands the handler the typed object. The child leaves out a stored key its dataclass or
TypedDict no longer has (the jobs an older release queued); the producer's check refuses it.

Dataclasses and TypedDicts are checked here against their annotations: the
JSON types (str, int, float, bool, None), ``list[...]``, ``dict[str, ...]``,
``tuple[X, ...]`` and ``tuple[X, Y]`` (a JSON list; the handler gets a tuple),
``set[X]`` and ``frozenset[X]`` (a JSON list; the handler gets the set),
``X | None``, ``Literal[...]``, ``Any``, a ``NewType`` of any of these, and nested
dataclasses or TypedDicts (their ``NotRequired``/``Required`` keys too, under
``from __future__ import annotations`` as well).
An annotation outside that set is accepted as it comes, and so is one naming
what the module imports only for a type checker (``if TYPE_CHECKING:``). A dataclass's
``field(init=False)`` is not part of its payload (the class computes it), an
``InitVar`` is (its constructor takes it), and a
ValueError or TypeError the schema's own code raises as it builds the object
(``__post_init__``, a validator) is a payload that does not match, like any other.
"""
import dataclasses
import sys
import types
import typing

from .errors import BadInput
from .jsonvalues import MAX_ERROR_MESSAGE, clip_start


class SchemaError(ValueError):
    """A payload that does not match its schema; the message names the field and the expected type."""


def kind_of(schema):
    """"dataclass", "typeddict", "pydantic" or "msgspec"; ValueError for anything else."""
    if isinstance(schema, type):
        if dataclasses.is_dataclass(schema):
            return "dataclass"
        if typing.is_typeddict(schema):
            return "typeddict"
        if any(c.__module__.startswith("pydantic") and c.__name__ == "BaseModel" for c in schema.__mro__):
            return "pydantic"
        if any(c.__module__.startswith("msgspec") and c.__name__ == "Struct" for c in schema.__mro__):
            return "msgspec"
    raise ValueError(f"payload schema must be a dataclass, a TypedDict, a pydantic model or a msgspec Struct,"
                     f" got {schema!r}")


def dump(schema, value):
    """The JSON payload to store for ``value`` (an instance of ``schema`` or a dict); raises ``BadInput``."""
    kind = kind_of(schema)
    if kind == "dataclass" and isinstance(value, schema):
        value = _as_json(value)
    elif kind == "pydantic" and isinstance(value, schema):
        value = _pydantic_payload(schema, value)
    elif kind == "msgspec" and isinstance(value, schema):
        import msgspec

        value = msgspec.to_builtins(value, str_keys=True)  # dict[int, ...] as JSON keys, as pydantic does
    if not isinstance(value, dict):
        raise BadInput(f"payload must be a {schema.__name__} or a JSON object, got {type(value).__name__}")
    try:
        load(schema, value)
    except SchemaError as exc:
        raise BadInput(f"payload: {exc}") from None
    return value


def _pydantic_payload(schema, value):
    """The instance under the names its model reads back (``model_validate``, in the child): a
    field's names, or its aliases (``alias=`` is read back; a ``serialization_alias`` is not)."""
    by_name = value.model_dump(mode="json")
    try:
        _load_pydantic(schema, by_name)
    except SchemaError:
        by_alias = value.model_dump(mode="json", by_alias=True)
        return by_alias if by_alias != by_name else by_name  # the check below names what is wrong
    return by_name


def load(schema, payload, stored=False):
    """The typed object for ``payload``; raises ``SchemaError``. A ``stored`` payload (the child's,
    written by whatever release enqueued it) may hold keys its dataclass or TypedDict no longer
    has: they are left out, as pydantic and msgspec leave them by default, so a release that drops
    a field does not dead-letter the jobs queued before it. A producer's payload is checked whole."""
    kind = kind_of(schema)
    if kind == "pydantic":
        return _load_pydantic(schema, payload)
    if kind == "msgspec":
        return _load_msgspec(schema, payload)
    return _check(schema, payload, "", stored)


def _load_pydantic(schema, payload):
    import pydantic

    try:
        return schema.model_validate(payload)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "payload"
        raise SchemaError(f"{where}: {first['msg']}") from None
    except (ValueError, TypeError) as exc:  # pydantic passes a validator's TypeError through
        raise SchemaError(_refused(schema, exc)) from None


def _load_msgspec(schema, payload):
    import msgspec

    try:
        return msgspec.convert(payload, schema, str_keys=True)  # and back
    except msgspec.ValidationError as exc:
        raise SchemaError(str(exc).replace("$.", "", 1)) from None  # "Expected `int`, got `str` - at `order_id`"
    except (ValueError, TypeError) as exc:
        raise SchemaError(_refused(schema, exc)) from None


def _name(tp):
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check(tp, value, path, stored=False):
    """``value`` checked against the annotation ``tp``; dataclasses are built, the rest returned as is."""
    where = path or "payload"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any or isinstance(tp, typing.TypeVar):
        return value
    if isinstance(tp, dataclasses.InitVar):
        return _check(tp.type, value, path, stored)
    if isinstance(tp, typing.NewType):  # OrderId = NewType("OrderId", int): an int
        return _check(tp.__supertype__, value, path, stored)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _check(option, value, path, stored)
            except SchemaError:
                continue
        raise SchemaError(f"{where}: expected {' | '.join(_name(a) for a in args)}, got {_json_name(value)}")
    if origin is typing.Literal:
        # By type too: True == 1 == 1.0 in Python, but a payload's true is no Literal[1].
        if not any(value == a and (type(value) is type(a) or type(a) not in _SCALARS) for a in args):
            raise SchemaError(f"{where}: expected one of {', '.join(repr(a) for a in args)}, got {value!r}")
        return value
    if isinstance(tp, type) and (dataclasses.is_dataclass(tp) or typing.is_typeddict(tp)):
        return _check_record(tp, value, path, stored)
    if origin in (list, tuple, set, frozenset) or tp in (list, tuple):
        if not isinstance(value, list):
            raise SchemaError(f"{where}: expected a list, got {_json_name(value)}")
        if (origin is tuple or tp is tuple) and args and args[-1] is not Ellipsis:
            # tuple[int, str]: a fixed length, a type per position.
            if len(value) != len(args):
                raise SchemaError(f"{where}: expected a list of {len(args)} items"
                                  f" ({', '.join(_name(a) for a in args)}), got {len(value)}")
            return tuple(_check(item, v, f"{path}[{i}]", stored)
                         for i, (item, v) in enumerate(zip(args, value)))
        item = args[0] if args else typing.Any
        items = [_check(item, v, f"{path}[{i}]", stored) for i, v in enumerate(value)]
        if origin in (set, frozenset):
            return _as_set(origin, items, where)
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected an object, got {_json_name(value)}")
        item = args[1] if len(args) == 2 else typing.Any
        return {k: _check(item, v, f"{path}.{k}" if path else k, stored) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(f"{where}: expected float, got {_json_name(value)}")
        try:
            return float(value)  # JSON's 1 is a float field's 1.0, as pydantic and msgspec hand it over
        except OverflowError:
            raise SchemaError(f"{where}: {value} is too large for a float") from None
    if tp in (int, str, bool, type(None)) or tp is None:
        tp = type(None) if tp is None else tp
        if type(value) is not tp:  # bool is an int in Python, never in a payload
            raise SchemaError(f"{where}: expected {_name(tp)}, got {_json_name(value)}")
        return value
    return value  # an annotation this checker does not know: accepted as it comes


def _check_record(tp, value, path, stored=False):
    where = path or "payload"
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: expected an object ({tp.__name__}), got {_json_name(value)}")
    hints = _hints(tp)
    if dataclasses.is_dataclass(tp):
        # An InitVar is no field (``fields`` leaves it out), but its constructor takes it: a payload key.
        init_vars = [f for f in tp.__dataclass_fields__.values() if isinstance(hints.get(f.name), dataclasses.InitVar)]
        fields = [f for f in dataclasses.fields(tp) if f.init] + init_vars
        required = {f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}
        names = {f.name for f in fields}
        computed = {f.name for f in dataclasses.fields(tp) if not f.init}
    else:
        required, names, computed = _required_keys(tp), set(hints), set()
    prefix = f"{path}." if path else ""
    if stored:
        value = {key: v for key, v in value.items() if key in names}
    for key in value:
        if key in computed:
            raise SchemaError(f"{prefix}{key}: not an init field of {tp.__name__} (field(init=False)),"
                              f" so no payload sets it")
        if key not in names:
            raise SchemaError(f"{prefix}{key}: unknown field of {tp.__name__}")
    for key in sorted(required - set(value)):
        raise SchemaError(f"{prefix}{key}: missing (expected {_name(hints.get(key, typing.Any))})")
    checked = {key: _check(hints.get(key, typing.Any), v, prefix + key, stored) for key, v in value.items()}
    if not dataclasses.is_dataclass(tp):
        return checked
    try:
        return tp(**checked)
    except (ValueError, TypeError) as exc:  # its __post_init__ refused the values: the payload's fault
        raise SchemaError(f"{path + ': ' if path else ''}{_refused(tp, exc)}") from None


def _hints(tp, extras=False):
    """The resolved annotations of a dataclass or TypedDict. One that names what the module does
    not hold at run time (imported under ``if TYPE_CHECKING:``) is ``Any``, accepted as it comes
    like any annotation this checker does not know, and the other fields are still checked: it
    failed every check with NameError, a traceback at enqueue and a retried job in the child."""
    try:
        return typing.get_type_hints(tp, include_extras=extras)
    except Exception:  # noqa: BLE001 - NameError, or a string that is no expression: one at a time below
        pass
    hints = {}
    for klass in reversed(tp.__mro__):
        module = sys.modules.get(klass.__module__)
        scope = (vars(module) if module is not None else {}, dict(vars(klass)))
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            one = type("annotation", (), {"__annotations__": {name: annotation}})
            try:
                hints[name] = typing.get_type_hints(one, *scope, include_extras=extras)[name]
            except Exception:  # noqa: BLE001 - as above
                hints[name] = typing.Any
    return hints


def _required_keys(tp):
    """A TypedDict's required keys. ``__required_keys__`` alone is wrong under ``from __future__
    import annotations`` on Python 3.11: the class cannot see a ``NotRequired[...]`` or
    ``Required[...]`` inside a string, so the annotations' own marks decide where they are."""
    required = set(tp.__required_keys__)
    for key, hint in _hints(tp, extras=True).items():
        mark = typing.get_origin(hint)
        if mark is typing.NotRequired:
            required.discard(key)
        elif mark is typing.Required:
            required.add(key)
    return required


def _refused(schema, exc):
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - the exception's own __str__
        text = "<unprintable>"
    return clip_start(f"{schema.__name__} refused it: {type(exc).__name__}: {text}", MAX_ERROR_MESSAGE)


_SCALARS = (str, int, float, bool, type(None))


def _as_json(value):
    """A dataclass instance as its payload: its init fields only (the ones ``load`` passes back
    to the class; an ``init=False`` field is the class's to compute), tuples and sets as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_json(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, (set, frozenset)):
        try:
            value = sorted(value)  # one payload for one set, whatever its hash order
        except TypeError:
            pass
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value


def _as_set(kind, items, where):
    try:
        return kind(items)
    except TypeError:  # set[list[int]]: a list is no set member
        raise SchemaError(f"{where}: items of a set must be hashable, got a list or an object") from None


def _json_name(value):
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}.get(
        type(value), type(value).__name__)


def check_cli_payload(load, type_name, payload):
    """``tangguh enqueue``: check ``payload`` against its handler's schema when the handler modules
    can be imported (``load()``: ``cli.common.import_handlers``); a producer without the handler
    code is not held up (the child checks again). Returns ``(payload, queue)``, ``queue`` the one
    the handler's decorator names (None: none, or no handler to read), as ``.enqueue()`` uses it.
    Raises ``BadInput``."""
    from .registry import HandlerLoadError

    try:
        spec = load().get(type_name)
    except HandlerLoadError:
        return payload, None
    if spec is None:
        return payload, None
    return (payload if spec.payload is None else dump(spec.payload, payload)), spec.queue


def for_handler(spec, payload):
    """In the child, before the handler runs: the typed payload, or ``BadPayload`` (dead at once)."""
    if spec.payload is None:
        return payload
    from .retry import BadPayload

    try:
        return load(spec.payload, payload, stored=True)
    except SchemaError as exc:
        raise BadPayload(f"payload: {exc}") from None
