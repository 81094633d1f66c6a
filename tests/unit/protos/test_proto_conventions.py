"""STYLE.md's proto conventions, checked on the descriptors: package, field comments, enum prefixes."""

from __future__ import annotations

import re

import pytest
from google.protobuf import descriptor_pb2

from llmserve import protogen
from llmserve.v1 import common_pb2, generation_pb2, scheduler_pb2, worker_pb2

MODULES = [common_pb2, worker_pb2, scheduler_pb2, generation_pb2]


def _file_proto(module) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_package_is_versioned(module) -> None:
    assert module.DESCRIPTOR.package == "llmserve.v1"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_enum_values_are_prefixed(module) -> None:
    for enum in module.DESCRIPTOR.enum_types_by_name.values():
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
        assert [v.name for v in enum.values if not v.name.startswith(prefix)] == []
        assert enum.values_by_number[0].name == prefix + "UNSPECIFIED"


def _uncommented(path) -> list[str]:
    """Fields and messages in a .proto source not directly preceded by a // comment."""
    missing = []
    previous = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        declares = re.match(
            r"(message|enum|service|rpc|oneof)\s|(optional |repeated )?[\w.]+ \w+ = \d+;", stripped
        )
        if declares and not previous.startswith("//"):
            missing.append(stripped)
        if stripped:
            previous = stripped
    return missing


@pytest.mark.parametrize("path", protogen.proto_files(), ids=lambda p: p.name)
def test_every_declaration_is_commented(path) -> None:
    assert _uncommented(path) == []


def test_uncommented_declarations_are_found(tmp_path) -> None:
    proto = tmp_path / "x.proto"
    proto.write_text(
        "// A message.\nmessage A {\n  // Commented.\n  uint32 a = 1;\n  repeated string b = 2;\n"
        "  optional bool c = 3;\n}\nmessage B {}\n"
    )
    assert _uncommented(proto) == ["repeated string b = 2;", "optional bool c = 3;", "message B {}"]
