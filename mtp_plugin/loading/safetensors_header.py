"""A safetensors header, read and checked before any byte it describes is trusted: one check for local files and for
Hub files read by ranges. The rules are the format's own (the safetensors library's ``Metadata::validate``): a
length within the file and 100 MB, a JSON object, known dtypes, shapes and sizes that agree, and tensors that tile
the data section exactly (no gap, no overlap). Design: docs/checkpoints.md#what-is-checked-before-a-byte-is-read."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER = 100_000_000  # bytes: the safetensors library's own limit
MAX_DIM = 2**31 - 1  # mlx's shapes are int32
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "C64": 64}  # the dtypes ``mx.load`` reads


class HeaderError(ValueError):
    """Why a header cannot be trusted, naming the tensor where one is at fault (not the file: the caller adds it)."""


@dataclass(frozen=True)
class Header:
    """A checked header: ``entries`` ``{name: {"dtype", "shape", "data_offsets"}}`` in data order (offsets relative
    to the data section); ``metadata`` the ``__metadata__`` object or None; ``data_start`` the data section's offset
    in the file (bytes)."""

    entries: dict[str, dict]
    metadata: dict[str, str] | None
    data_start: int

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, dtype)}``, as ``mtp_read_tensor_names`` answers."""
        return {n: (tuple(e["shape"]), e["dtype"]) for n, e in self.entries.items()}


def read_header(read: Callable[[int, int], bytes], size: int) -> Header:
    """The checked header of a safetensors file of ``size`` bytes; ``read(start, end)`` returns bytes ``[start,
    end)`` (two calls: the length, then the JSON). HeaderError: any rule broken."""
    if size < 8:
        raise HeaderError(f"{size} bytes, too short for a safetensors file")
    length = int.from_bytes(read(0, 8), "little")
    if length > min(MAX_HEADER, size - 8):
        raise HeaderError(f"its header length {length} exceeds the file's {size} bytes or {MAX_HEADER} bytes")
    try:  # UTF-8 only (``json.loads`` of bytes would take UTF-16 too); nesting and digits bounded by json itself
        header = json.loads(read(8, 8 + length).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise HeaderError(f"its header is not UTF-8 JSON ({str(e)[:120]})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"its header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise HeaderError("its __metadata__ is not an object of strings")
    if not all(map(_encodes, [*header, *(metadata or {}), *(metadata or {}).values()])):
        raise HeaderError("a name or metadata string is not valid UTF-8 (a lone surrogate)")
    for name, entry in header.items():
        _check_entry(name, entry)
    entries = dict(sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])))
    end = 0
    for name, entry in entries.items():
        begin = entry["data_offsets"][0]
        if begin != end:
            raise HeaderError(f"tensor {name!r}: data_offsets {entry['data_offsets']} "
                              f"{'overlap another tensor' if begin < end else 'leave a gap before it'}")
        end = entry["data_offsets"][1]
    if end != size - 8 - length:
        raise HeaderError(f"its tensors hold {end} bytes of a {size - 8 - length}-byte data section")
    return Header(entries, metadata, 8 + length)


def read_local_header(path: Path) -> Header:
    """``read_header`` of a local file. OSError: it cannot be opened or read."""
    with open(path, "rb") as f:
        def read(start: int, end: int) -> bytes:
            f.seek(start)
            return f.read(end - start)

        return read_header(read, os.fstat(f.fileno()).st_size)


def _check_entry(name: str, entry) -> None:
    if not isinstance(entry, dict):
        raise HeaderError(f"tensor {name!r}: its entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise HeaderError(f"tensor {name!r}: dtype {dtype!r} is unknown or one mlx cannot read")
    if not isinstance(shape, list) or not all(_natural(d) and d <= MAX_DIM for d in shape):
        raise HeaderError(f"tensor {name!r}: shape {str(shape)[:80]} is not a list of integers 0..{MAX_DIM}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))
            and offsets[0] <= offsets[1]):
        raise HeaderError(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits != 8 * (offsets[1] - offsets[0]):
        raise HeaderError(f"tensor {name!r}: {dtype} {shape} needs {bits / 8:g} bytes, its data_offsets give "
                          f"{offsets[1] - offsets[0]}")


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
