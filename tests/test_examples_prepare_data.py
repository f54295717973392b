"""examples/kimi_k25/prepare_data.py without a model: duplicate ids across JSON types, --limit."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "examples" / "kimi_k25" / "prepare_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class WordTokenizer:
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [4 + len(w) for w in text.split()]


def test_ids_that_print_alike_are_duplicates_and_bad_json_is_a_line_error(tmp_path):
    mod = _module()
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([json.dumps({"id": 1, "text": "a b"}), json.dumps({"id": "1", "text": "c"}),
                              '{"id": "x", "text": "' + "a" + '", "n": ' + "9" * 5000 + "}",
                              json.dumps({"id": "2", "text": "d e f"})]) + "\n")
    out = tmp_path / "out.jsonl"
    args = mod.parse_args(["--model-path", "m", "--input", str(src), "--output", str(out), "--on-bad-line", "skip"])
    written, tokens, problems = mod.convert(args, WordTokenizer())
    assert written == 2 and tokens == 3 + 4
    assert "line 2: duplicate id '1' (first on line 1" in problems[0]
    assert "line 3: bad JSON" in problems[1] and len(problems) == 2
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["1", "2"]


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_limit_must_be_positive(value, capsys):
    mod = _module()
    with pytest.raises(SystemExit):
        mod.parse_args(["--model-path", "m", "--input", "i", "--output", "o", "--limit", value])
    assert "--limit" in capsys.readouterr().err
