"""Pure decisions of a checkpoint fetch: which byte ranges to ask for, how to resume.

Every file of a checkpoint is cut into parts at fixed offsets (multiples of the part
size, :func:`part_size`: at most ``part_bytes``, and small enough that every one of the
fetch's connections gets about four parts of a file: the connections take parts from one
queue, so one that the fabric puts on a busy circuit takes fewer, and none idles while
another carries a long last part). The cut depends on the file's size and the number of
connections only: a fetch that starts again the same way plans the same parts, and one
that starts another way fetches again only the parts its record does not cover. Parts are
fetched over several connections at once;
a connection cut in the middle of a part resumes that part at the first byte not yet
written (:func:`rest_of`), and a part written whole is recorded as done
(:func:`record_done`), so a fetch interrupted altogether (the agent restarted) asks only
for the parts it does not have (:func:`plan_parts`). The record is kept beside the
partial checkpoint as JSON (:func:`progress_json`, :func:`parse_progress`); a record that
does not read back, or is of another checkpoint, counts as nothing done.

The server side cuts a read into chunks (:func:`chunk_spans`); the reader checks each
chunk lands where it expects it (:func:`chunk_problem`). No I/O here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from orchestrrl import errors
from orchestrrl.checkpoint import FileEntry

MIB = 1024 * 1024
DEFAULT_PART_BYTES = 8 * MIB
MIN_PART_BYTES = 256 * 1024
PART_ALIGN = 64 * 1024
PARTS_PER_STREAM = 4
MAX_CHUNK_BYTES = MIB  # a CheckpointChunk's data, at most
DEFAULT_STREAMS = 4
MAX_STREAMS = 16
PROGRESS_FORMAT = "orchestrrl-fetch-progress/1"

Spans = tuple[tuple[int, int], ...]  # [start, end) byte ranges, sorted, merged


@dataclass(frozen=True, order=True)
class Part:
    """Bytes [start, end) of one file."""

    file: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def check_part_bytes(part_bytes: int) -> int:
    if part_bytes < 1:
        raise errors.field_error("part_bytes", part_bytes, "a positive number of bytes")
    return part_bytes


def check_streams(streams: int, field: str = "streams") -> int:
    """0 means the default; else 1..MAX_STREAMS."""
    if streams == 0:
        return DEFAULT_STREAMS
    if not 1 <= streams <= MAX_STREAMS:
        raise errors.field_error(
            field, streams, f"0 (default {DEFAULT_STREAMS}) or 1..{MAX_STREAMS}"
        )
    return streams


def part_size(size: int, part_bytes: int, streams: int = 1) -> int:
    """The part size of a file of ``size`` bytes: at most ``part_bytes``; for a file that
    ``streams`` connections would otherwise share unevenly, about ``size / (4 streams)``
    (a multiple of 64 KiB, at least 256 KiB, and never more than ``part_bytes``)."""
    check_part_bytes(part_bytes)
    even = -(-size // (PARTS_PER_STREAM * max(1, streams)))
    even = -(-even // PART_ALIGN) * PART_ALIGN
    return min(part_bytes, max(MIN_PART_BYTES, even))


def cut(entry: FileEntry, part_bytes: int, streams: int = 1) -> tuple[Part, ...]:
    """The parts of one file (none for an empty file)."""
    step = part_size(entry.size, part_bytes, streams)
    return tuple(
        Part(entry.name, start, min(start + step, entry.size))
        for start in range(0, entry.size, step)
    )


def covered(spans: Sequence[tuple[int, int]], part: Part) -> bool:
    """Whether ``spans`` (sorted, merged) hold every byte of ``part``."""
    return any(s <= part.start and part.end <= e for s, e in spans)


def plan_parts(
    files: Iterable[FileEntry],
    done: Mapping[str, Spans],
    part_bytes: int = DEFAULT_PART_BYTES,
    streams: int = 1,
) -> tuple[Part, ...]:
    """The parts still to fetch, largest files first (so the connections finish
    together), then in offset order: every part of every file that ``done`` does not
    cover."""
    out: list[Part] = []
    for entry in sorted(files, key=lambda f: (-f.size, f.name)):
        spans = done.get(entry.name, ())
        out.extend(p for p in cut(entry, part_bytes, streams) if not covered(spans, p))
    return tuple(out)


def merge(spans: Iterable[tuple[int, int]]) -> Spans:
    """Sorted, with overlapping and touching ranges joined (empty ones dropped)."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(x for x in spans if x[1] > x[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return tuple(out)


def record_done(done: Mapping[str, Spans], part: Part) -> dict[str, Spans]:
    """``done`` with ``part`` added (a new mapping)."""
    out = dict(done)
    out[part.file] = merge([*done.get(part.file, ()), (part.start, part.end)])
    return out


def forget_file(done: Mapping[str, Spans], name: str) -> dict[str, Spans]:
    """``done`` without any byte of ``name`` (its bytes proved wrong: fetch it again)."""
    return {k: v for k, v in done.items() if k != name}


def rest_of(part: Part, written: int) -> Part:
    """What is left of ``part`` once its first ``written`` bytes are on disk (a cut
    connection: the next attempt asks for this)."""
    if not 0 <= written <= part.size:
        raise errors.field_error("written", written, f"0..{part.size} bytes of {part}")
    return Part(part.file, part.start + written, part.end)


def chunk_spans(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) in consecutive chunks of at most ``chunk`` bytes."""
    if chunk < 1:
        raise errors.field_error("chunk_bytes", chunk, f"1..{MAX_CHUNK_BYTES}")
    return [(s, min(s + chunk, end)) for s in range(start, end, chunk)]


def chunk_problem(part: Part, position: int, offset: int, size: int) -> str | None:
    """Why a chunk of ``size`` bytes at ``offset`` cannot be the next bytes of ``part``
    when ``position`` is the next byte expected (None: it can)."""
    if offset != position:
        return f"a chunk at byte {offset} of {part.file}, expected byte {position}"
    if size == 0:
        return f"an empty chunk at byte {offset} of {part.file}"
    if offset + size > part.end:
        return f"{size} bytes at byte {offset} of {part.file} run past the range's end {part.end}"
    return None


def progress_json(checksum: str, done: Mapping[str, Spans]) -> str:
    doc = {
        "format": PROGRESS_FORMAT,
        "checksum": checksum,
        "done": {name: [list(s) for s in spans] for name, spans in sorted(done.items())},
    }
    return json.dumps(doc, sort_keys=True)


def parse_progress(
    text: str | bytes, checksum: str, files: Iterable[FileEntry]
) -> dict[str, Spans]:
    """The done ranges recorded for checkpoint ``checksum``; nothing for a record that
    does not parse, is of another checkpoint, or names ranges outside the files."""
    sizes = {f.name: f.size for f in files}
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != PROGRESS_FORMAT:
        return {}
    if doc.get("checksum") != checksum or not isinstance(doc.get("done"), dict):
        return {}
    out: dict[str, Spans] = {}
    for name, spans in doc["done"].items():
        if name not in sizes or not isinstance(spans, list):
            return {}
        pairs = []
        for s in spans:
            if not (
                isinstance(s, list)
                and len(s) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
                and 0 <= s[0] <= s[1] <= sizes[name]
            ):
                return {}
            pairs.append((s[0], s[1]))
        out[name] = merge(pairs)
    return out


def done_bytes(done: Mapping[str, Spans]) -> int:
    return sum(e - s for spans in done.values() for s, e in spans)


def mbytes_per_s(nbytes: int, seconds: float) -> float:
    """MB/s (10^6 bytes); 0 when nothing moved or no time passed."""
    return nbytes / seconds / 1e6 if nbytes > 0 and seconds > 0 else 0.0


def to_prune(names: Sequence[str], serving: str, keep: int) -> list[str]:
    """Which checkpoint directories (``names``, oldest first) to remove after an update:
    all but the ``keep`` newest, never the one ``serving`` now."""
    if keep < 1:
        raise errors.field_error("checkpoint_keep", keep, "at least 1 (the served checkpoint)")
    kept = set(names[-keep:]) | {serving}
    return [n for n in names if n not in kept]
