"""What the fuzz tests send: every gRPC method the server serves (read from the protos'
descriptors), and hypothesis strategies that build any protobuf message field by field, with the
values a hostile client picks (NaN, the ends of every integer type, lone surrogates, deep Structs).
"""

from __future__ import annotations

import math

from google.protobuf import descriptor as d
from google.protobuf import struct_pb2
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2

from protos import generation_pb2


def rpc_methods() -> list[tuple[str, type, bool]]:
    """(path, request class, answers with a stream) of every served method."""
    out = []
    for module in (generation_pb2, vllm_engine_pb2, health_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                path = f"/{service.full_name}/{m.name}"
                out.append((path, GetMessageClass(m.input_type), m.server_streaming))
    return out


_INTS = {
    d.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# text as clients send it, and as they should not: a lone surrogate cannot even be serialized by
# protobuf, so it is not sent from here (the byte tests send invalid UTF-8)
_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=24),
    st.sampled_from(["", "0", "-1", "NaN", "{}", "[1, 2", '{"type": "object"}', "a" * 3000]),
)


def _int(lo: int, hi: int):
    ends = [lo, hi, 0, 1, -1 if lo < 0 else 2, 2**31 - 1 if hi > 2**31 else hi // 2]
    return st.one_of(st.sampled_from([x for x in ends if lo <= x <= hi]), st.integers(lo, hi))


def json_values(depth: int = 3):
    """Values a google.protobuf.Value can hold, with NaN and Infinity and deep nesting."""
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([math.nan, math.inf, 1e308]),
        _TEXT,
    )
    deep = st.integers(20, 95).map(lambda n: _nest(n))
    return st.one_of(
        st.recursive(
            leaf,
            lambda inner: st.one_of(
                st.lists(inner, max_size=3), st.dictionaries(_TEXT, inner, max_size=3)
            ),
            max_leaves=8,
        ),
        deep,
    )


def _nest(n: int):
    value: object = {"type": "string"}
    for _ in range(n):
        value = {"properties": {"x": value}}
    return value


def _struct():
    def build(data: dict) -> struct_pb2.Struct:
        s = struct_pb2.Struct()
        try:
            s.update(data)
        except (ValueError, RecursionError):  # deeper than protobuf builds: sent empty
            pass
        return s

    return st.dictionaries(_TEXT, json_values(), max_size=4).map(build)


def _scalar(f: d.FieldDescriptor):
    t = f.type
    if t in _INTS:
        return _int(*_INTS[t])
    if t in (d.FieldDescriptor.TYPE_FLOAT, d.FieldDescriptor.TYPE_DOUBLE):
        width = 32 if t == d.FieldDescriptor.TYPE_FLOAT else 64
        return st.one_of(
            st.floats(allow_nan=True, allow_infinity=True, width=width),
            st.sampled_from([0.0, -1.0, 1e30, math.nan, math.inf]),
        )
    if t == d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == d.FieldDescriptor.TYPE_STRING:
        return _TEXT
    if t == d.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == d.FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), _int(-5, 99))
    raise AssertionError(f"no strategy for {f.full_name}")


def _repeated(f: d.FieldDescriptor) -> bool:
    if hasattr(f, "is_repeated"):  # protobuf 6+ (label is gone in 7)
        return f.is_repeated
    return f.label == d.FieldDescriptor.LABEL_REPEATED


def messages(desc: d.Descriptor, depth: int = 3):
    """A strategy for messages of `desc`: each field set or left unset, recursively."""
    if desc.full_name == "google.protobuf.Struct":
        return _struct()
    cls = GetMessageClass(desc)
    fields = {}
    for f in desc.fields:
        if f.type == d.FieldDescriptor.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                key, value = (
                    f.message_type.fields_by_name["key"],
                    f.message_type.fields_by_name["value"],
                )
                if value.type == d.FieldDescriptor.TYPE_MESSAGE:
                    continue
                strat = st.dictionaries(_scalar(key), _scalar(value), max_size=3)
            elif depth <= 0:
                continue
            else:
                strat = messages(f.message_type, depth - 1)
        else:
            strat = _scalar(f)
        if _repeated(f) and not (f.message_type and f.message_type.GetOptions().map_entry):
            strat = st.lists(strat, max_size=3)
        fields[f.name] = st.one_of(st.none(), strat)

    def build(values: dict):
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            target = getattr(msg, name, None)
            f = desc.fields_by_name[name]
            if _repeated(f):
                if isinstance(value, dict):
                    target.update(value)
                elif f.type == d.FieldDescriptor.TYPE_MESSAGE:
                    for v in value:
                        target.add().CopyFrom(v)
                else:
                    target.extend(value)
            elif f.type == d.FieldDescriptor.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries({}, optional=fields).map(build)
