"""The pure decisions of a checkpoint fetch: parts, resume ranges, progress records."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.weights import plan
from node_agent.weights.plan import Part
from orchestrrl import errors
from orchestrrl.checkpoint import FileEntry

pytestmark = pytest.mark.unit

H = "0" * 64
files_st = st.lists(
    st.tuples(st.sampled_from(["config.json", "model.safetensors", "generation_config.json"]),
              st.integers(0, 5000)),
    max_size=3,
    unique_by=lambda t: t[0],
).map(lambda xs: tuple(FileEntry(n, s, H) for n, s in xs))  # fmt: skip


def bytes_of(parts: tuple[Part, ...]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for p in parts:
        out.setdefault(p.file, set()).update(range(p.start, p.end))
    return out


@given(files_st, st.integers(1, 700), st.integers(1, 16))
def test_the_parts_tile_every_file_once(
    files: tuple[FileEntry, ...], part_bytes: int, streams: int
) -> None:
    parts = plan.plan_parts(files, {}, part_bytes, streams)
    assert all(0 < p.size <= part_bytes for p in parts)
    assert sum(p.size for p in parts) == sum(f.size for f in files)
    assert bytes_of(parts) == {f.name: set(range(f.size)) for f in files if f.size}


@given(st.integers(0, 10**11), st.integers(1, 16))
def test_a_big_file_gives_every_connection_work(size: int, streams: int) -> None:
    step = plan.part_size(size, plan.DEFAULT_PART_BYTES, streams)
    assert plan.MIN_PART_BYTES <= step <= plan.DEFAULT_PART_BYTES
    assert step % plan.PART_ALIGN == 0
    k = plan.PARTS_PER_STREAM * streams
    if size >= k * plan.DEFAULT_PART_BYTES:  # a big file: parts of the most allowed
        assert step == plan.DEFAULT_PART_BYTES
    elif size >= k * plan.MIN_PART_BYTES:  # a middling one: about k parts
        assert k - streams <= -(-size // step) <= k
    # the same file and connections: the same cut (a resumed fetch plans the same parts)
    assert step == plan.part_size(size, plan.DEFAULT_PART_BYTES, streams)


@given(files_st, st.integers(1, 700), st.data())
def test_recording_parts_done_leaves_only_the_others(
    files: tuple[FileEntry, ...], part_bytes: int, data: st.DataObject
) -> None:
    parts = plan.plan_parts(files, {}, part_bytes)
    done_parts = data.draw(st.lists(st.sampled_from(parts), unique=True) if parts else st.just([]))
    done: dict[str, plan.Spans] = {}
    for p in done_parts:
        done = plan.record_done(done, p)
    left = plan.plan_parts(files, done, part_bytes)
    assert set(left) == set(parts) - set(done_parts)
    assert plan.done_bytes(done) == sum(p.size for p in done_parts)
    # the record survives its JSON, and only for its own checkpoint
    assert plan.parse_progress(plan.progress_json(H, done), H, files) == done
    assert plan.parse_progress(plan.progress_json(H, done), "1" * 64, files) == {}
    # every part done: nothing left
    for p in parts:
        done = plan.record_done(done, p)
    assert plan.plan_parts(files, done, part_bytes) == ()


@given(st.integers(0, 1000), st.integers(1, 1000), st.data())
def test_a_cut_part_resumes_at_its_first_missing_byte(
    start: int, size: int, data: st.DataObject
) -> None:
    part = Part("model.safetensors", start, start + size)
    written = data.draw(st.integers(0, size))
    rest = plan.rest_of(part, written)
    assert (rest.start, rest.end) == (start + written, part.end)
    with pytest.raises(errors.InvalidArgument, match="written"):
        plan.rest_of(part, size + 1)


@given(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(1, 3000))
def test_chunk_spans_cover_a_read_in_order(a: int, n: int, chunk: int) -> None:
    spans = plan.chunk_spans(a, a + n, chunk)
    assert [s for s, _ in spans] == list(range(a, a + n, chunk))
    assert sum(e - s for s, e in spans) == n and all(e - s <= chunk for s, e in spans)


def test_a_chunk_out_of_place_is_named() -> None:
    part = Part("model.safetensors", 100, 200)
    assert plan.chunk_problem(part, 120, 120, 80) is None
    assert "expected byte 120" in (plan.chunk_problem(part, 120, 130, 10) or "")
    assert "run past" in (plan.chunk_problem(part, 120, 120, 81) or "")
    assert "empty" in (plan.chunk_problem(part, 120, 120, 0) or "")


def test_a_record_that_does_not_read_back_counts_as_nothing_done() -> None:
    files = (FileEntry("model.safetensors", 100, H),)
    good = plan.progress_json(H, {"model.safetensors": ((0, 50),)})
    assert plan.parse_progress(good, H, files) == {"model.safetensors": ((0, 50),)}
    for bad in [
        "not json",
        "[]",
        good.replace("orchestrrl-fetch-progress/1", "x"),
        plan.progress_json(H, {"model.safetensors": ((0, 101),)}),  # past the end
        plan.progress_json(H, {"other.bin": ((0, 1),)}),
    ]:
        assert plan.parse_progress(bad, H, files) == {}


def test_merge_joins_touching_ranges() -> None:
    assert plan.merge([(5, 9), (0, 5), (20, 30), (25, 26), (40, 40)]) == ((0, 9), (20, 30))


def test_streams_and_rates() -> None:
    assert plan.check_streams(0) == plan.DEFAULT_STREAMS and plan.check_streams(16) == 16
    with pytest.raises(errors.InvalidArgument, match="streams=17"):
        plan.check_streams(17)
    assert plan.mbytes_per_s(5_000_000, 2.0) == 2.5 and plan.mbytes_per_s(0, 1.0) == 0.0


def test_pruning_keeps_the_newest_and_the_served() -> None:
    names = ["1-a", "2-b", "3-c", "4-d"]
    assert plan.to_prune(names, "4-d", 2) == ["1-a", "2-b"]
    assert plan.to_prune(names, "1-a", 2) == ["2-b"]  # a rolled-back node keeps its own
    assert plan.to_prune(names, "4-d", 10) == []
    with pytest.raises(errors.InvalidArgument, match="checkpoint_keep"):
        plan.to_prune(names, "4-d", 0)
