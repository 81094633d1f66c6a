"""Every field of every llmserve.v1 message is read or written somewhere in the package code.

A field nobody sets or reads is a promise the contract does not keep: remove it and reserve
its number. The check greps the package sources (not tests, not the generated stubs) for the
field's name used as an attribute (`msg.name`), a keyword (`name=`) or a string naming it
(`HasField("name")`, `WhichOneof`, `ClearField`). It cannot tell two messages' fields of the
same name apart; it does catch a name no code mentions at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor

from llmserve.v1 import common_pb2, generation_pb2, scheduler_pb2, worker_pb2

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ["llmserve", "gateway", "scheduler_service", "worker_service"]
MODULES = [common_pb2, generation_pb2, scheduler_pb2, worker_pb2]

# Fields no code names, each with the reason. Keep this tiny.
ALLOWED: dict[str, str] = {}


def _sources() -> str:
    texts = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "v1" not in path.relative_to(ROOT).parts:  # generated stubs
                texts.append(path.read_text())
    return "\n".join(texts)


def _messages(descriptor: Descriptor) -> Iterator[Descriptor]:
    yield descriptor
    for nested in descriptor.nested_types:
        if not nested.GetOptions().map_entry:
            yield from _messages(nested)


def _fields() -> list[str]:
    names = []
    for module in MODULES:
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for m in _messages(message):
                names += [f"{m.full_name}.{f.name}" for f in m.fields]
    return names


SOURCES = _sources()


@pytest.mark.parametrize("qualified", _fields())
def test_field_is_used(qualified: str) -> None:
    if qualified in ALLOWED:
        return
    name = qualified.rsplit(".", 1)[1]
    used = re.search(rf"\.{name}\b|\b{name}\s*=[^=]|[\"']{name}[\"']", SOURCES)
    assert used, f"{qualified}: no package code reads or writes it"


def test_allow_list_names_real_fields() -> None:
    assert set(ALLOWED) <= set(_fields())
