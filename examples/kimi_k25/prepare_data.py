"""Step 1 of the Kimi-K2.5 EAGLE-3 pipeline: text -> token ids, with the model's own tokenizer.

Input: JSONL, one object a line, either ``{"id"?: ..., "text": "..."}`` or
``{"id"?: ..., "messages": [{"role": "user"|"assistant"|..., "content": "..."}, ...]}``.
Output: JSONL for ``extract_hidden_states.py``: ``{"id", "input_ids", "loss_mask"}``.

- ``text``: tokenized as is (with the tokenizer's special tokens, e.g. BOS); ``loss_mask`` all ones.
- ``messages``: rendered with the chat template (the tokenizer's, or ``--chat-template FILE``);
  ``loss_mask`` is 1 on the tokens of assistant turns (their content and end-of-turn marker, not
  the role header that the template adds before them) and 0 elsewhere.

How the mask is found: the template is rendered for each prefix of the conversation, which gives
the character span of every assistant turn; the text is tokenized span by span (tokenizers such as
Kimi's tiktoken one have no offset mapping). Templates whose rendering of a prefix is not a prefix
of the whole (some drop earlier reasoning) cannot be split this way: such lines are reported.

Lines without ``id`` get ``<input stem>-<line number>``. Ids are written as strings; two lines whose
ids print alike (``1`` and ``"1"``) are duplicates and reported. ``loss_mask`` holds the integers
0 and 1 only. The output is written to a temporary
file and renamed into place at the end, so a killed run never leaves a half-written output.

    python prepare_data.py --model-path /models/Kimi-K2.5 --trust-remote-code \
        --input conversations.jsonl --output prepared.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from speccompat.dataset.extract import positive_int

logger = logging.getLogger("prepare_data")


class BadLine(ValueError):
    """One input line cannot be used; the message says why."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Tokenize text or chat JSONL for extract_hidden_states.py",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model-path", required=True, help="model (or tokenizer) directory or hub id")
    ap.add_argument("--input", required=True, type=Path, help='JSONL with "text" or "messages" per line')
    ap.add_argument("--output", required=True, type=Path, help="tokenized JSONL to write")
    ap.add_argument("--chat-template", type=Path, default=None,
                    help="Jinja chat template file (default: the tokenizer's own)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="allow the tokenizer's own code (needed for Kimi-K2.5)")
    ap.add_argument("--limit", type=positive_int, default=None, help="stop after N written samples")
    ap.add_argument("--on-bad-line", choices=("skip", "fail"), default="fail",
                    help="unusable lines: skip them with a warning, or stop (nothing written)")
    ap.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO")
    return ap.parse_args(argv)


def load_tokenizer(args: argparse.Namespace) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_path, trust_remote_code=args.trust_remote_code)
    if args.chat_template is not None:
        tok.chat_template = args.chat_template.read_text()
    return tok


def encode(tok: Any, text: str, *, special: bool) -> list[int]:
    return list(tok.encode(text, add_special_tokens=special))


def tokenize_text(tok: Any, text: Any) -> tuple[list[int], list[int]]:
    if not isinstance(text, str) or not text:
        raise BadLine(f'"text" must be a non-empty string, got {type(text).__name__}')
    ids = encode(tok, text, special=True)
    return ids, [1] * len(ids)


def render(tok: Any, messages: list[dict], *, generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tok: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    full = render(tok, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tok, messages[:i], generation_prompt=True) if i else ""
        upto = render(tok, messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise BadLine(f"the chat template does not render message {i} as a continuation of the "
                          "previous ones; the assistant tokens cannot be located")
        spans.append((len(before), len(upto)))
    return full, spans


def tokenize_messages(tok: Any, messages: Any) -> tuple[list[int], list[int]]:
    check_messages(messages)
    if not getattr(tok, "chat_template", None):
        raise BadLine('"messages" given but the tokenizer has no chat template (pass --chat-template)')
    full, spans = assistant_spans(tok, messages)
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for start, end in [*spans, (len(full), len(full))]:
        for piece, flag in ((full[pos:start], 0), (full[start:end], 1)):
            if piece:
                piece_ids = encode(tok, piece, special=False)
                ids += piece_ids
                mask += [flag] * len(piece_ids)
        pos = end
    if not any(mask):
        logger.debug("a conversation without assistant tokens (loss_mask all zero)")
    return ids, mask


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadLine('"messages" must be a non-empty list')
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadLine(f'"messages"[{i}] must be {{"role": str, "content": str}}')


def convert_line(tok: Any, raw: bytes, default_id: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError as exc:  # also UnicodeDecodeError and over-long integers
        raise BadLine(f"bad JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        ids, mask = tokenize_messages(tok, obj["messages"])
    elif "text" in obj:
        ids, mask = tokenize_text(tok, obj["text"])
    else:
        raise BadLine('neither "text" nor "messages"')
    if not ids:
        raise BadLine("tokenizes to nothing")
    sample_id = obj.get("id", default_id)
    if isinstance(sample_id, bool) or not isinstance(sample_id, (str, int)):
        raise BadLine(f'"id" must be a string or an integer, got {type(sample_id).__name__}')
    return {"id": str(sample_id), "input_ids": ids, "loss_mask": mask}


def convert(args: argparse.Namespace, tok: Any) -> tuple[int, int, list[str]]:
    """Write the output (atomically). Returns (samples, tokens, problems)."""
    tmp = args.output.with_name(args.output.name + f".{os.getpid()}.partial")
    written = tokens = 0
    problems: list[str] = []
    first_line_of: dict[str, int] = {}  # ids as written: 1 and "1" are the same id
    args.output.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(args.input, "rb") as src, open(tmp, "w") as dst:
            for lineno, raw in enumerate(src, start=1):
                if args.limit is not None and written >= args.limit:
                    break
                if not raw.strip():
                    continue
                try:
                    rec = convert_line(tok, raw, f"{args.input.stem}-{lineno}")
                    if rec["id"] in first_line_of:
                        raise BadLine(f"duplicate id {rec['id']!r} (first on line {first_line_of[rec['id']]}; "
                                      "ids that print alike are the same id)")
                    first_line_of[rec["id"]] = lineno
                except BadLine as exc:
                    problems.append(f"{args.input} line {lineno}: {exc}")
                    if args.on_bad_line == "fail":
                        raise BadLine(problems[-1]) from None
                    logger.warning("%s -> skipped", problems[-1])
                    continue
                dst.write(json.dumps(rec) + "\n")
                written += 1
                tokens += len(rec["input_ids"])
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, args.output)
    finally:
        tmp.unlink(missing_ok=True)
    return written, tokens, problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    tok = load_tokenizer(args)
    try:
        written, tokens, problems = convert(args, tok)
    except BadLine as exc:
        logger.error("%s; nothing written (fix it, or pass --on-bad-line skip)", exc)
        return 2
    except OSError as exc:
        logger.error("%s", exc)
        return 2
    logger.info("wrote %d samples (%d tokens) to %s; %d lines skipped", written, tokens, args.output,
                len(problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
