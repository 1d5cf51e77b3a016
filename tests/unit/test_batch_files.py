"""gateway/batch/files.py: validation reads an input file chunk by chunk with the file's own line numbers (blank lines
counted, not run), and each stored offset reads its line back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from gateway.batch.files import LineScan, read_at, read_lines

URL = "/v1/chat/completions"


def _line(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL,
                       "body": {"model": "m3", "messages": [{"role": "user", "content": custom_id}]}})


def _scan(path: Path, chunk: int) -> tuple[LineScan, list[tuple[int, str, str, int, int]]]:
    scan, rows = LineScan(URL, frozenset({"m3"}), 10_000), []
    while (got := scan.next_chunk(path, chunk)) is not None:
        rows += got
    return scan, rows


def test_chunks_give_the_same_rows_with_the_files_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([_line("a"), "", _line("b"), "   ", _line("c")]) + "\n")
    scan, rows = _scan(path, chunk=2)
    assert [(r[0], r[1]) for r in rows] == [(1, "a"), (3, "b"), (5, "c")]
    assert scan.requests == 3 and not scan.errors
    assert _scan(path, chunk=1000)[1] == rows
    for _, custom_id, _, pos, length in rows:
        assert orjson.loads(read_at(path, pos, length))["custom_id"] == custom_id


def test_errors_carry_the_line_and_a_duplicate_is_found_across_chunks(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([_line("a"), _line("b"), "", "{bad", _line("a")]))  # no final newline
    scan, rows = _scan(path, chunk=2)
    assert [(e.line, e.code) for e in scan.errors] == [(4, "invalid_json_line"), (5, "duplicate_custom_id")]
    assert [r[1] for r in rows] == ["a", "b"]


def test_a_chunk_stops_at_its_byte_bound_but_never_empty(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(_line(c) + "\n" for c in "abcd"))
    one = len(_line("a")) + 1
    assert [raw for _, raw in read_lines(path, 0, 100, max_bytes=2 * one)] == [_line(c).encode() + b"\n" for c in "ab"]
    assert len(read_lines(path, 0, 100, max_bytes=1)) == 1
