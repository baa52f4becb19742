"""Read an offline W&B run back record by record: its ``run-<id>.wandb`` transaction log.

The file is W&B's LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of the type byte and the payload,
payload length, type: 1 full, 2 first, 3 middle, 4 last); a record is one full chunk or a first,
middle... last sequence, and its payload is a ``wandb_internal_pb2.Record`` (the SDK ships the
protobuf types, not a reader). A file cut short (a killed job) ends at its last whole record.
"""

from __future__ import annotations

import collections
import json
import struct
import zlib
from pathlib import Path

HEADER = b":W&B\xe1\xbe\x00"
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path):
    """The records' payloads of a .wandb file, in order; stops at a torn or corrupt chunk."""
    data = Path(path).read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    pos, parts = len(HEADER), []
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        payload = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        if len(payload) < length or zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            return
        pos += CHUNK_HEADER + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            parts = [payload]
        elif kind == MIDDLE:
            parts.append(payload)
        elif kind == LAST:
            yield b"".join(parts + [payload])
            parts = []


def records(path: Path) -> list:
    """The ``Record`` protobufs of a .wandb file."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for payload in payloads(path):
        rec = pb.Record()
        rec.ParseFromString(payload)
        out.append(rec)
    return out


def kinds(recs) -> collections.Counter:
    """How many records of each type (``history``, ``summary``, ``artifact``, ``exit``, ...)."""
    return collections.Counter(r.WhichOneof("record_type") for r in recs)


def history(recs) -> list[dict]:
    """The history rows, each as ``{key: value}``."""
    rows = []
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return rows


def summary(recs) -> dict:
    """The summary the records leave (later updates win)."""
    out = {}
    for r in recs:
        if r.WhichOneof("record_type") == "summary":
            for u in r.summary.update:
                out["/".join(u.nested_key) or u.key] = json.loads(u.value_json)
    return out


def run_file(job_dir: Path) -> Path:
    """The .wandb file of the one offline run under ``job_dir/wandb``."""
    found = sorted(Path(job_dir).glob("wandb/offline-run-*/run-*.wandb"))
    if len(found) != 1:
        raise AssertionError(f"expected one offline run under {job_dir}/wandb, found {found}")
    return found[0]
