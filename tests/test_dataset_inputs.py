"""The input check of a prepared data file (speccompat.dataset.inputs): every bad line named with
its number, a byte order mark, duplicate keys, long lines truncated, skipped or failed."""

from __future__ import annotations

import json

import pytest
from support.dataset_fakes import VOCAB, jsonl

from speccompat.dataset import Rejected


def test_every_bad_line_is_reported_with_its_line_number(tmp_path):
    from speccompat.dataset.inputs import scan_jsonl

    good = {"id": "ok", "input_ids": [5, 6, 7]}
    lines = [
        json.dumps(good),
        '{"id": "big", "input_ids": [5, ' + "9" * 5000 + "]}",                   # 2 int too long for str()
        json.dumps({"id": "f", "input_ids": [5, 6.0]}),                           # 3 float
        json.dumps({"id": "b", "input_ids": [5, True]}),                          # 4 bool
        json.dumps({"id": True, "input_ids": [5]}),                               # 5 bool id
        json.dumps({"id": "oov", "input_ids": [5, VOCAB]}),                       # 6 outside vocabulary
        json.dumps({"id": "m", "input_ids": [5, 6], "loss_mask": [1, 0.5]}),      # 7 float mask
        json.dumps({"id": "m2", "input_ids": [5, 6], "loss_mask": [1, True]}),    # 8 bool mask
        json.dumps({"id": 7, "input_ids": [5]}),                                  # 9 int id "7"
        json.dumps({"id": "7", "input_ids": [5]}),                                # 10 same id as a string
        "[1, 2]",                                                                 # 11 not an object
        '{"id": "x", "input_ids": [5',                                            # 12 bad JSON
        json.dumps({"id": "neg", "input_ids": [-1]}),                             # 13 negative
        json.dumps({"id": "big2", "input_ids": [10 ** 30]}),                      # 14 huge but convertible
    ]
    raw = ("\n".join(lines) + "\n").encode() + b'{"id": "\xff"}\n'                # 15 not UTF-8
    path = tmp_path / "in.jsonl"
    path.write_bytes(raw)
    scan = scan_jsonl(path, vocab_size=VOCAB, max_seq_len=100)
    got = {p.line: p.reason for p in scan.problems}
    expect = {2: "4300 digits", 3: "6.0 is not an integer", 4: "True is not an integer", 5: '"id" must be',
              6: "outside the vocabulary", 7: "0.5 is not the integer 0 or 1", 8: "True is not the integer",
              10: "duplicate id '7' (first on line 9)", 11: "expected a JSON object", 12: "bad JSON",
              13: "outside the vocabulary", 14: "outside the vocabulary", 15: "not UTF-8"}
    assert sorted(got) == sorted(expect), got
    for line, phrase in expect.items():
        assert phrase in got[line], (line, got[line])
    assert [s.id for s in scan.samples] == ["ok", "7"]
    assert all(p.fatal for p in scan.problems)
    with pytest.raises(Rejected, match=r"13 unusable line\(s\)"):
        from speccompat.dataset.inputs import report_scan

        report_scan(scan, 100)


def test_a_byte_order_mark_is_accepted_and_a_duplicate_key_refused_naming_line_and_key(tmp_path):
    from speccompat.dataset.inputs import scan_jsonl

    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "input_ids": [5, 6]}).encode() + b"\n"
                     + b'{"id": "b", "input_ids": [5, 6], "input_ids": [7]}\n'
                     + b'{"id": "c", "input_ids": [5], "loss_mask": [1], "loss_mask": [0]}\n'
                     + json.dumps({"id": "d", "input_ids": [8]}).encode() + b"\n")
    scan = scan_jsonl(path, vocab_size=VOCAB, max_seq_len=100)
    assert [(s.id, list(s.input_ids)) for s in scan.samples] == [("a", [5, 6]), ("d", [8])]
    assert [(p.line, p.reason) for p in scan.problems] == [
        (2, "duplicate key 'input_ids' in a JSON object: which value is meant cannot be told"),
        (3, "duplicate key 'loss_mask' in a JSON object: which value is meant cannot be told")]
    assert all(p.fatal for p in scan.problems)


def test_long_lines_truncate_skip_or_fail(tmp_path):
    from speccompat.dataset.inputs import scan_jsonl

    path = jsonl(tmp_path / "in.jsonl", [{"id": "l", "input_ids": list(range(4, 20)), "loss_mask": [1] * 16}])
    s = scan_jsonl(path, vocab_size=VOCAB, max_seq_len=10).samples[0]
    assert s.num_tokens == 10 and s.truncated_from == 16 and len(s.loss_mask) == 10
    assert scan_jsonl(path, vocab_size=VOCAB, max_seq_len=10, on_long="skip").samples == []
    assert scan_jsonl(path, vocab_size=VOCAB, max_seq_len=10, on_long="fail").problems[0].fatal
