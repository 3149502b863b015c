"""SageMaker-shaped dicts to and from the wire messages.

Field names are the proto's in PascalCase (`endpoint_config_name` <-> `EndpointConfigName`);
routing strategies are the names users type (`RANDOM`, `LEAST_OUTSTANDING_REQUESTS`,
`PREFIX_AWARE`). A SageMaker ProductionVariants document pastes in as is: fields this API does
not have (`InstanceType`, `InitialInstanceCount`, ...) are ignored, `Instances` is ours, and
either the bare list or an object holding `ProductionVariants` is accepted, as JSON text, a
`file://PATH`, or Python lists and dicts (the CLI's `--production-variants` accepts the same).
"""

import json
import re

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from ._proto import prefixrouter_pb2 as pb

STRATEGY_PREFIX = "ROUTING_STRATEGY_"
#: The strategy names users type.
STRATEGIES = ("RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE")
PRIORITY_PREFIX = "REQUEST_PRIORITY_"
PRIORITIES = ("CRITICAL", "STANDARD", "SHEDDABLE")


def pascal(name: str) -> str:
    """`endpoint_config_name` -> `EndpointConfigName`."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def snake(name: str) -> str:
    """`EndpointConfigName` -> `endpoint_config_name` (already snake_case names pass through)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def _user_name(enum, prefix: str, unset: str, value: int) -> str:
    """The user name of a wire enum value (`unset` for 0; `UNKNOWN(n)` for a value this SDK does
    not know)."""
    try:
        name = enum.Name(value)
    except ValueError:
        return f"UNKNOWN({value})"
    if name == prefix + "UNSPECIFIED":
        return unset
    return name[len(prefix):]


def _parse_name(enum, prefix: str, names: tuple, what: str, name, variant: str) -> int:
    """A user-typed enum name (any case, or the proto name) to its wire value; ValueError names
    `what`, the value and the choices."""
    if isinstance(name, int) and not isinstance(name, bool) and name in enum.values():
        return name
    text = name.strip().upper() if isinstance(name, str) else ""
    short = text[len(prefix):] if text.startswith(prefix) else text
    if short not in names:
        where = f" for variant {variant!r}" if variant else ""
        raise ValueError(f"unknown {what} {name!r}{where} (expected {', '.join(names)})")
    return enum.Value(prefix + short)


def strategy_name(value: int) -> str:
    """The user name of a wire strategy value (`UNKNOWN(n)` for a value this SDK does not know)."""
    return _user_name(pb.RoutingStrategy, STRATEGY_PREFIX, "RANDOM", value)


def parse_strategy(name, variant: str = "") -> int:
    """A user-typed strategy name (or the proto name) to its wire value; ValueError names it."""
    return _parse_name(pb.RoutingStrategy, STRATEGY_PREFIX, STRATEGIES, "routing strategy", name, variant)


def priority_name(value: int) -> str:
    """The user name of a wire priority value (unset is STANDARD)."""
    return _user_name(pb.RequestPriority, PRIORITY_PREFIX, "STANDARD", value)


def parse_priority(name, variant: str = "") -> int:
    """A user-typed priority name (any case, or the proto name) to its wire value; ValueError
    names it."""
    return _parse_name(pb.RequestPriority, PRIORITY_PREFIX, PRIORITIES, "DefaultPriority", name, variant)


def to_dict(message: Message) -> dict:
    """A message as a PascalCase dict: every field (unset scalars at their default, unset
    optional fields left out), strategies by user name, integers as ints."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        key = pascal(field.name)
        if field.is_repeated:
            out[key] = [_value(field, v) for v in value]
        elif field.has_presence and not message.HasField(field.name):
            if field.type != FieldDescriptor.TYPE_MESSAGE:
                continue
            out[key] = None
        else:
            out[key] = _value(field, value)
    return out


def _value(field, value):
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM and field.enum_type.name == "RoutingStrategy":
        return strategy_name(value)
    if field.type == FieldDescriptor.TYPE_ENUM and field.enum_type.name == "RequestPriority":
        return priority_name(value)
    return value


def from_dict(doc: dict, message_type, where: str = ""):
    """A PascalCase (or snake_case) dict as a message of `message_type`; unknown keys ignored.
    ValueError names the field and the value."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where or message_type.DESCRIPTOR.name} must be an object, got {doc!r}")
    message = message_type()
    fields = message.DESCRIPTOR.fields_by_name
    for key, value in doc.items():
        name = snake(key)
        field = fields.get(name)
        if field is None or value is None:
            continue
        path = f"{where}.{key}" if where else key
        if field.is_repeated:
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{path} must be a list, got {value!r}")
            target = getattr(message, name)
            for i, item in enumerate(value):
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    target.append(from_dict(item, message_factory.GetMessageClass(field.message_type), f"{path}[{i}]"))
                else:
                    target.append(_scalar(field, item, f"{path}[{i}]", doc))
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(message, name).CopyFrom(
                from_dict(value, message_factory.GetMessageClass(field.message_type), path)
            )
        else:
            setattr(message, name, _scalar(field, value, path, doc))
    return message


def _scalar(field, value, path, doc):
    if field.type == FieldDescriptor.TYPE_ENUM:
        variant = doc.get("VariantName", "") if isinstance(doc, dict) else ""
        if field.enum_type.name == "RequestPriority":
            return parse_priority(value, variant)
        return parse_strategy(value, variant)
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path} must be a number, got {value!r}")
        return float(value)
    if field.type == FieldDescriptor.TYPE_STRING:
        if not isinstance(value, str):
            raise ValueError(f"{path} must be a string, got {value!r}")
        return value
    if field.type == FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, bool):
            raise ValueError(f"{path} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 and field.type in (
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64,
    ):
        raise ValueError(f"{path} must be a non-negative integer, got {value!r}")
    return value


def production_variants(value) -> list:
    """ProductionVariants as the CLI accepts them: JSON text, `file://PATH`, a list of dicts, or
    a dict holding `ProductionVariants` (a describe answer). Returns `ProductionVariant`s."""
    source = "ProductionVariants"
    if isinstance(value, str):
        text = value
        if value.startswith("file://"):
            path = value[len("file://"):]
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise ValueError(f"cannot read ProductionVariants file {path!r}: {e}") from None
            source = f"ProductionVariants in file {path!r}"
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid {source}: {e}") from None
    if isinstance(value, dict):
        if "ProductionVariants" not in value:
            raise ValueError(f"{source}: an object must hold \"ProductionVariants\", got keys {sorted(value)}")
        value = value["ProductionVariants"]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{source} must be a list of variants, got {value!r}")
    variants = []
    for i, doc in enumerate(value):
        if not isinstance(doc, dict) or not (doc.get("VariantName") or doc.get("variant_name")):
            raise ValueError(f"{source}[{i}]: missing field VariantName in {doc!r}")
        variants.append(from_dict(doc, pb.ProductionVariant, f"{source}[{i}]"))
    return variants
