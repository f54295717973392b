"""The example pipeline (examples/kimi_k25) end to end on the real CPU engine, with the tiny
Kimi-K2.5 checkpoint (``KimiK25ForConditionalGeneration``: a vision tower around the DeepseekV3
language model; text-only prompts), its tokenizer made remote code as Kimi-K2.5's: prepare_data.py,
then extract_hidden_states.py as a subprocess.

The word range and the vocabulary size come from the checkpoint itself: Kimi's special and media
tokens sit above the 512 words, inside the vocabulary, and a text prompt must not contain them.

Six engine start-ups in all: the shared run (mixed input, bad lines skipped, hostile ids, files
checked against transformers, then every refusal that must come before an engine: bad lines, a
changed model, a changed loss_mask, a colliding default of layer ids, unusable output dirs; and
``speccompat verify`` on planted problems), a run that fills its disk (a small tmpfs) mid-run, its
resume (with a same-size corruption planted in a finished file; the result is byte-identical to
the uninterrupted run), a run killed with SIGKILL and its resume (byte-identical too), and a
``--format speculators`` run read by speculators' own loaders. The SIGKILL run is engine_full: the
gate shows a killed run's resume in test_scale_out's chain and a byte-identical resume here after
the full disk (four engine starts in the gate)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.engine_env import ENGINE_ENV

from speccompat.testing.parity import measure, violations

from .conftest import MLA_CPU_REASON, mla_runs_here, skip_unless_model_runs
from .crash_hook import crash_env, crashed_after

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(ENGINE_ENV is not None and not mla_runs_here(),
                       reason="the tiny Kimi model's language model is a DeepseekV3: " + MLA_CPU_REASON),
]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "kimi_k25"
#: The example's stand-in model: Kimi-K2.5's own architecture (KimiK25ForConditionalGeneration), tiny.
STAND_IN = "kimi_k25"
LAYER_IDS = [1, 2, 4, 5]  # includes the last layer of the 6-layer tiny model
HIDDEN = 256
MAX_SEQ_LEN = 256
TIMEOUT = 900
#: Checkpoint overrides (none: the tiny MoE checkpoints route by a checked margin, so no token
#: switches experts on bf16 noise and the driver's files compare tightly with transformers; the
#: same checkpoint as test_parity's kimi_k25).
NO_FLIPS: dict = {}
EPOCH = "1700000000"  # SOURCE_DATE_EPOCH: the provenance's date, so that runs compare byte for byte


def _env(speculators: str = "0.4.0.1") -> dict[str, str]:
    """The scripts' environment: speculators unpacked on PYTHONPATH, before what the caller has there
    (e.g. the checkout whose speccompat is tested)."""
    path = os.pathsep.join(p for p in (ENGINE_ENV["speculators"][speculators], os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **ENGINE_ENV.get("engine_env", {}), "PYTHONPATH": path, "SOURCE_DATE_EPOCH": EPOCH}


def driver_args(model: Path, data: Path, out: Path, *extra: str, layers: bool = True) -> list[str]:
    return [
        sys.executable, str(EXAMPLE / "extract_hidden_states.py"),
        "--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
        *(["--layer-ids", *map(str, LAYER_IDS)] if layers else []), "--max-seq-len", str(MAX_SEQ_LEN),
        "--batch-size", "2", "--tp-size", "1", "--gpu-memory-utilization", "0.1", *extra,
    ]


def run_driver(model: Path, data: Path, out: Path, *extra: str, layers: bool = True,
               speculators: str = "0.4.0.1") -> subprocess.CompletedProcess:
    """Run the driver to its end; its output is also kept in ``driver-<n>.log`` beside ``data``."""
    proc = subprocess.run(driver_args(model, data, out, *extra, layers=layers), capture_output=True, text=True,
                          env=_env(speculators), timeout=TIMEOUT, cwd=REPO)
    n = len(list(data.parent.glob("driver-*.log")))
    (data.parent / f"driver-{n}.log").write_text(f"{proc.args}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def verify(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "speccompat", "verify", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


#: Kimi-K2.5's tokenizer is code shipped with the model (``TikTokenTokenizer``, no tokenizer.json);
#: this slow tokenizer plays that part for the tiny checkpoint. It reads the vocabulary the
#: checkpoint ships (``vocab.json``, written from its tokenizer.json: the words and the special and
#: media tokens above them); the added tokens are restored from tokenizer_config.json.
REMOTE_TOKENIZER = '''
import json

from transformers import PreTrainedTokenizer


class RemoteTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "vocab.json"}

    def __init__(self, vocab_file, **kwargs):
        with open(vocab_file) as f:
            self.vocab = json.load(f)
        self.words = {i: w for w, i in self.vocab.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    def _tokenize(self, text):
        return text.split()

    def _convert_token_to_id(self, token):
        return self.vocab.get(token, self.vocab["<unk>"])

    def _convert_id_to_token(self, index):
        return self.words.get(index, "<unk>")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


_ADDED_TOKEN_FIELDS = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
#: Plain words, a special token and media tokens (with and without spaces): both tokenizers must agree.
_PROBE = "w5 w6 </s> w7<|media_begin|> <|media_pad|>w8 <|media_end|> w511"


def with_remote_code_tokenizer(ckpt: Path, dst: Path) -> Path:
    """A copy of ``ckpt`` whose tokenizer loads only with ``trust_remote_code``, like Kimi-K2.5's,
    with the vocabulary, added tokens and chat template of the tokenizer ``ckpt`` ships."""
    from transformers import AutoTokenizer

    shutil.copytree(ckpt, dst)
    doc = json.loads((dst / "tokenizer.json").read_text())
    (dst / "tokenizer.json").unlink()
    added = doc.get("added_tokens", [])
    vocab = {**doc["model"]["vocab"], **{a["content"]: a["id"] for a in added}}
    (dst / "vocab.json").write_text(json.dumps(vocab, indent=0))
    (dst / "tokenization_remote.py").write_text(REMOTE_TOKENIZER)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "RemoteTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_remote.RemoteTokenizer", None]}
    cfg["added_tokens_decoder"] = {str(a["id"]): {k: a[k] for k in _ADDED_TOKEN_FIELDS} for a in added}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    shipped, remote = AutoTokenizer.from_pretrained(ckpt), AutoTokenizer.from_pretrained(dst, trust_remote_code=True)
    assert type(remote).__name__ == "RemoteTokenizer" and remote.get_vocab() == shipped.get_vocab()
    assert remote.encode(_PROBE) == shipped.encode(_PROBE), (remote.encode(_PROBE), shipped.encode(_PROBE))
    assert remote.apply_chat_template(CHAT["messages"], tokenize=False) == \
        shipped.apply_chat_template(CHAT["messages"], tokenize=False)
    return dst


def checkpoint_vocab(model: Path) -> tuple[int, list[int]]:
    """The model's vocabulary size (its text config's: the engine's embedding rows, what the driver
    checks token ids against) and the ids of its plain words: the tokens of the tokenizer it ships
    that are neither special nor added (Kimi's special and media tokens, above the words)."""
    from transformers import AutoTokenizer

    cfg = json.loads((model / "config.json").read_text())
    size = int(cfg.get("text_config", cfg)["vocab_size"])
    tok = AutoTokenizer.from_pretrained(model)
    reserved = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    words = sorted(i for i in tok.get_vocab().values() if i not in reserved)
    assert words and len(tok) <= size and max(words) < size, (len(tok), size)
    return size, words


def random_ids(rng: random.Random, n: int, words: list[int]) -> list[int]:
    return [rng.choice(words) for _ in range(n)]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def manifest(out: Path) -> tuple[dict, dict[str, dict]]:
    """(header, id -> entry) of a data set."""
    lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    return lines[0], {e["id"]: e for e in lines[1:]}


def load_sample(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def snapshot(out: Path) -> dict[str, tuple]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in out.iterdir()
            if not p.name.endswith(".lock")}


def parity(samples: list[tuple[list[int], dict]], references) -> list[str]:
    ref32, ref16 = references(STAND_IN, **NO_FLIPS)
    results = [{"hidden_states": [t[f"hidden_states_{i}"] for i in LAYER_IDS]} for _, t in samples]
    return violations(measure(results, [ref32.hidden_states(ids, LAYER_IDS) for ids, _ in samples],
                              [ref16.hidden_states(ids, LAYER_IDS) for ids, _ in samples]))


CHAT = {"id": "chat-1", "messages": [
    {"role": "user", "content": "w10 w11 w12"}, {"role": "assistant", "content": "w20 w21"},
    {"role": "user", "content": "w13"}, {"role": "assistant", "content": "w22 w23 w24"},
]}
#: Ids whose old file names collided or that a file system could fold together.
HOSTILE = ["a/b", "a_b-3ec69c85a4", "a_b", "..", "A", "a", "x" * 300, "日本", "nul\u0000id"]


class SharedRun:
    """The driver on a mixed input (``--on-bad-line skip``); its outcome is checked by the tests below.
    Token ids are the checkpoint's plain words; ``vocab_size`` is the first id outside its vocabulary."""

    def __init__(self, root: Path, model: Path, vocab_size: int, words: list[int]) -> None:
        self.root, self.model, self.out = root, model, root / "out"
        self.vocab_size, self.words = vocab_size, words
        rng = random.Random(5)
        self.prepared = self._prepare(root)
        chat = json.loads(self.prepared.read_text().splitlines()[0])
        self.expected: dict[str, tuple[int, list[int], list[int] | None]] = {}
        self.bad: dict[int, str] = {}  # line -> a phrase its report must contain
        lines: list[str] = []

        def good(sample_id: str, ids: list[int], mask: list[int] | None = None) -> None:
            record = {"id": sample_id, "input_ids": ids, **({"loss_mask": mask} if mask else {})}
            lines.append(json.dumps(record))
            self.expected[sample_id] = (len(lines), ids[:MAX_SEQ_LEN], mask[:MAX_SEQ_LEN] if mask else None)

        def bad(text: str, phrase: str) -> None:
            lines.append(text)
            self.bad[len(lines)] = phrase

        good(chat["id"], chat["input_ids"], chat["loss_mask"])
        good("r-40", random_ids(rng, 40, words))
        good("r-255", random_ids(rng, 255, words), [0] * 100 + [1] * 155)
        good("r-256", random_ids(rng, MAX_SEQ_LEN, words))  # exactly --max-seq-len: kept whole
        good("r-120", random_ids(rng, 120, words))
        good("r-200", random_ids(rng, 200, words))
        bad('{"id": "broken", "input_ids": [5, 6', "bad JSON")
        bad(json.dumps({"id": "str-token", "input_ids": [5, "6"]}), "is not an integer")
        bad('{"id": "huge", "input_ids": [5, ' + "7" * 5000 + "]}", "4300 digits")
        bad(json.dumps({"id": "float", "input_ids": [5, 6.0]}), "6.0 is not an integer")
        bad(json.dumps({"id": "bool", "input_ids": [5, True]}), "True is not an integer")
        bad(json.dumps({"id": "empty", "input_ids": []}), "is empty")
        bad(json.dumps({"id": "oov", "input_ids": [5, vocab_size]}), "outside the vocabulary")
        bad(json.dumps({"id": "oov-far", "input_ids": [vocab_size + 4096, 5]}), "outside the vocabulary")
        bad(json.dumps({"id": "r-40", "input_ids": [5, 6]}), "duplicate id 'r-40'")
        bad(json.dumps({"id": "mask", "input_ids": [5, 6], "loss_mask": [1, 0.0]}), "is not the integer 0 or 1")
        lines.append("")  # blank lines are ignored
        ids = random_ids(rng, 300, words)
        good("dir/long sample", ids, [1] * 300)  # truncated to 256
        self.long_line = len(lines)
        for k, hid in enumerate(HOSTILE):
            good(hid, random_ids(rng, 30 + k, words))
        self.data = write_jsonl(root / "data.jsonl", lines)
        self.proc = run_driver(model, self.data, self.out, "--on-bad-line", "skip")

    def _prepare(self, root: Path) -> Path:
        src = write_jsonl(root / "text.jsonl", [json.dumps(CHAT), json.dumps({"text": "w5 w6 w7"})])
        dst = root / "prepared.jsonl"
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE / "prepare_data.py"), "--model-path", str(self.model),
             "--trust-remote-code", "--input", str(src), "--output", str(dst)],
            capture_output=True, text=True, env=_env(), timeout=TIMEOUT, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        return dst

    def file_of(self, sample_id: str) -> Path:
        return self.out / manifest(self.out)[1][sample_id]["file"]


@pytest.fixture(scope="module")
def shared(engines, tmp_path_factory) -> SharedRun:
    root = tmp_path_factory.mktemp("kimi-shared")
    skip_unless_model_runs(STAND_IN)
    ckpt = engines.checkpoint(STAND_IN, **NO_FLIPS)
    model = with_remote_code_tokenizer(ckpt, root / "model")
    return SharedRun(root, model, *checkpoint_vocab(ckpt))


def test_prepare_data_masks_assistant_tokens(shared):
    chat, text = map(json.loads, shared.prepared.read_text().splitlines())
    assert chat["id"] == "chat-1" and text["id"] == "text-2"
    trained = [t for t, m in zip(chat["input_ids"], chat["loss_mask"], strict=True) if m]
    assert trained == [20, 21, 2, 22, 23, 24, 2]
    assert text["input_ids"] == [5, 6, 7] and text["loss_mask"] == [1, 1, 1]


def test_end_to_end_matches_transformers_and_keeps_every_hostile_id(shared, references):
    proc = shared.proc
    assert proc.returncode == 0, proc.stderr[-5000:]
    err = proc.stderr
    for line, phrase in shared.bad.items():
        report = next((ln for ln in err.splitlines() if f"data.jsonl line {line}:" in ln), "")
        assert phrase in report and "skipped" in report, f"line {line} not reported as {phrase!r}:\n{err}"
    assert f"data.jsonl line {shared.long_line}: id 'dir/long sample' has 300 tokens, truncated to" in err
    assert "stats id 'chat-1' layer 5" in err
    assert f"summary: {len(shared.expected)} written, 0 already done (skipped), 0 failed" in err

    header, entries = manifest(shared.out)
    assert sorted(entries) == sorted(shared.expected)  # every hostile id has its own file
    assert len({e["file"].lower() for e in entries.values()}) == len(entries)
    prov = header["provenance"]
    assert prov["hidden_states"]["layer_ids"] == LAYER_IDS and prov["model"]["config_sha256"]
    assert [r["vllm_aux_id"] for r in prov["hidden_states"]["layers"]] == [2, 3, 5, 6]
    assert "speculators >= 0.5: train with --target-layer-ids 2 3 5" in proc.stdout  # printed at the end
    assert '{"eagle_aux_hidden_state_layer_ids": [2, 3, 5]}' in proc.stdout
    assert prov["speccompat"]["adapter"] and "generator.generate" in prov["speccompat"]["patches"]
    assert prov["versions"]["vllm"] == ENGINE_ENV["vllm"] and prov["created"] == "2023-11-14T22:13:20Z"
    assert entries["dir/long sample"]["truncated_from"] == 300
    samples = []
    for sample_id, (line, ids, mask) in shared.expected.items():
        tensors, meta = load_sample(shared.file_of(sample_id))
        assert entries[sample_id]["line"] == line
        assert tensors["input_ids"].tolist() == ids
        assert (tensors["loss_mask"].tolist() if mask else None) == mask
        assert json.loads(meta["speccompat_provenance"]) == prov
        for i in LAYER_IDS:
            assert tuple(tensors[f"hidden_states_{i}"].shape) == (len(ids), HIDDEN)
        samples.append((ids, tensors))
    assert not list(shared.out.glob("*.partial"))
    v = verify(shared.out)
    assert v.returncode == 0, v.stdout + v.stderr
    bad = parity(samples, references)
    assert not bad, "\n".join(bad[:15])


def test_refusals_come_before_any_engine_and_touch_nothing(shared, tmp_path):
    """Bad lines, a changed model, a changed loss_mask, a colliding layer default, unusable output dirs."""
    before = snapshot(shared.out)

    proc = run_driver(shared.model, shared.data, shared.out, "--on-bad-line", "fail", "--on-long-line", "fail")
    assert proc.returncode == 2, proc.stderr[-3000:]
    for line in [*shared.bad, shared.long_line]:
        assert f"data.jsonl line {line}:" in proc.stderr
    assert f"{len(shared.bad) + 1} unusable line(s)" in proc.stderr

    other = tmp_path / "other-model"
    shutil.copytree(shared.model, other)
    cfg = json.loads((other / "config.json").read_text())
    text = cfg.get("text_config", cfg)  # the language model's (Kimi-K2.5: text_config)
    text["rope_theta"] = text.get("rope_theta", 10000.0) * 2
    (other / "config.json").write_text(json.dumps(cfg))
    proc = run_driver(other, shared.data, shared.out, "--on-bad-line", "skip")
    assert proc.returncode == 2 and "model.config_sha256" in proc.stderr, proc.stderr[-3000:]

    lines = shared.data.read_text().splitlines()
    rec = json.loads(lines[2])  # r-255, with a loss mask
    rec["loss_mask"] = [1] * len(rec["input_ids"])
    lines[2] = json.dumps(rec)
    changed = write_jsonl(tmp_path / "changed.jsonl", lines)
    proc = run_driver(shared.model, changed, shared.out, "--on-bad-line", "skip")
    assert proc.returncode == 2 and "id 'r-255' (line 3): input_ids/loss_mask differ" in proc.stderr, proc.stderr[-3000:]

    proc = run_driver(shared.model, shared.data, tmp_path / "fresh", "--on-bad-line", "skip", layers=False)
    assert proc.returncode == 2 and "[2, 3, 3, 5]" in proc.stderr, proc.stderr[-3000:]

    afile = tmp_path / "a-file"
    afile.write_text("")
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True).returncode == 0
    try:
        cases = [(afile, "is not a directory"), (Path("/sys/speccompat-test"), "cannot create --output-dir")]
        if mounted:
            cases.append((ro, "read-only"))
        for out, phrase in cases:
            proc = run_driver(shared.model, shared.data, out, "--on-bad-line", "skip")
            assert proc.returncode == 2 and phrase in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], capture_output=True)

    text = json.loads((shared.model / "config.json").read_text())
    text = text.get("text_config", text)
    limit, heads = text["max_position_embeddings"], text["num_attention_heads"]
    fresh = tmp_path / "refused"
    proc = run_driver(shared.model, shared.data, fresh, "--on-bad-line", "skip", "--max-seq-len", str(limit),
                      "--tp-size", str(heads + 1))  # settings config.json decides: before apply() or any engine
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"--max-seq-len {limit}: the engine gets max_model_len = max_seq_len + 1 = {limit + 1}" in proc.stderr
    assert f"--tp-size {heads + 1}: the model's {heads} attention heads" in proc.stderr
    assert "speccompat: armed" not in proc.stderr and not fresh.exists()  # apply() was not called

    proc = run_driver(shared.model, shared.data, shared.out, "--on-bad-line", "skip")  # nothing to do
    assert proc.returncode == 0 and "nothing to do" in proc.stderr, proc.stderr[-3000:]
    for p in (proc,):
        assert "starting the engine" not in p.stderr
    assert snapshot(shared.out) == before


def test_verify_finds_every_planted_problem(shared, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(shared.out, out)
    _, entries = manifest(out)
    (out / entries["r-40"]["file"]).unlink()
    victim = out / entries["r-120"]["file"]
    data = bytearray(victim.read_bytes())
    data[-512:] = b"\xc0\x7f" * 256  # NaN in place, same size
    victim.write_bytes(bytes(data))
    (out / "notes.txt").write_text("")
    proc = verify(out)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert any(entries["r-40"]["file"] + ": missing" in x for x in lines), lines
    assert any(victim.name + ": hidden_states_5 checksum differs" in x for x in lines), lines
    assert any(victim.name + ": hidden_states_5 has 256 non-finite" in x for x in lines), lines
    assert any("notes.txt: extra file" in x for x in lines), lines
    assert len(lines) == 4, lines


# --------------------------------------------------------------------------------------------
# A full disk in the middle of a run, then the resume
# --------------------------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_mid_run_loses_nothing_and_the_resume_is_byte_identical(shared, tmpfs):
    out = tmpfs / "hs"
    limit = ["--limit", "6", "--on-bad-line", "skip"]
    log = shared.root / "full-disk.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(driver_args(shared.model, shared.data, out, *limit), stdout=f, stderr=subprocess.STDOUT,
                                env=_env(), cwd=REPO, text=True)
        deadline = time.monotonic() + TIMEOUT
        while "starting the engine" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        # the disk fills while the engine starts: room for about two more sample files
        room = shutil.disk_usage(tmpfs).free - 1_300_000
        (tmpfs / "filler").write_bytes(b"\0" * max(room, 0))
        proc.wait(timeout=TIMEOUT)
    err = log.read_text()
    assert proc.returncode == 1, err[-4000:]
    assert f"no space left on {out}" in err and "the engine failed" not in err, err[-4000:]
    _, entries = manifest(out)
    finished = {p.name for p in out.glob("*.safetensors")}
    assert 1 <= len(entries) < 6 and finished == {e["file"] for e in entries.values()}
    assert not list(out.glob("*.partial"))
    assert verify(out).returncode == 0  # what is there is complete and listed

    # free the disk; corrupt one finished file in place (same size) before resuming
    (tmpfs / "filler").unlink()
    victim = out / next(iter(entries.values()))["file"]
    data = bytearray(victim.read_bytes())
    data[-64:] = b"\xc0\x7f" * 32
    victim.write_bytes(bytes(data))
    proc2 = run_driver(shared.model, shared.data, out, *limit)
    assert proc2.returncode == 0, proc2.stderr[-4000:]
    assert f"{victim.name} (id" in proc2.stderr and "checksum differs from the manifest" in proc2.stderr
    assert f"summary: {6 - len(entries) + 1} written, {len(entries) - 1} already done" in proc2.stderr
    _, after = manifest(out)
    assert len(after) == 6
    for sample_id, e in after.items():  # byte for byte what the uninterrupted shared run wrote
        assert (out / e["file"]).read_bytes() == shared.file_of(sample_id).read_bytes(), sample_id
    assert verify(out).returncode == 0


@pytest.mark.engine_full
def test_sigkill_then_resume_is_byte_identical_and_rewrites_nothing(shared, tmp_path):
    import signal

    out = tmp_path / "hs"
    limit = ["--limit", "6", "--on-bad-line", "skip"]
    # the driver and its engine workers die once 2 samples are committed, like a crash
    env = crash_env(_env(), after=2, argv=f"--output-dir {out}", group=True)
    proc = subprocess.Popen(driver_args(shared.model, shared.data, out, *limit), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True)
    log = proc.communicate(timeout=TIMEOUT)[0]
    (tmp_path / "killed.log").write_text(log)
    assert proc.returncode == -signal.SIGKILL, log[-3000:]
    killed_after = crashed_after(log)
    for _ in range(200):  # the whole process group gone
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    _, entries = manifest(out)
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.safetensors")}
    assert len(finished) == killed_after < 6 and set(finished) <= {e["file"] for e in entries.values()}
    proc2 = run_driver(shared.model, shared.data, out, *limit)
    assert proc2.returncode == 0, proc2.stderr[-4000:]
    _, after = manifest(out)
    assert len(after) == 6 and not list(out.glob("*.partial"))
    for sample_id, e in after.items():
        assert (out / e["file"]).read_bytes() == shared.file_of(sample_id).read_bytes(), sample_id
    still = {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in finished}
    assert still == finished, "finished files were rewritten"


# --------------------------------------------------------------------------------------------
# --format speculators, read by speculators' own training data loader
# --------------------------------------------------------------------------------------------

LOADER = """
import json, sys, torch
from speculators.train.data import Eagle3SampleFileDataset
d = Eagle3SampleFileDataset(max_len=4096, datapath=sys.argv[1], hidden_states_dtype=torch.bfloat16)
out = {}
for k, path in enumerate(d.data):
    item = d[k]
    out[path.name] = {"input_ids": item["input_ids"].tolist(), "loss_mask": item["loss_mask"].tolist(),
                      "hs_sum": float(item["hidden_states"].float().sum()),
                      "last_sum": float(item["verifier_last_hidden_states"].float().sum())}
print(json.dumps(out))
"""


def test_format_speculators_is_read_by_speculators_own_loaders(shared):
    out = shared.root / "spec"
    proc = run_driver(shared.model, shared.data, out, "--format", "speculators", "--limit", "4",
                      "--on-bad-line", "skip")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir() if p.name.endswith("pt")) == [f"data_{i}.pt" for i in range(4)]
    assert (out / "data_config.json").is_file() and (out / "sample_lengths.json").is_file()
    assert Path(str(out) + ".token_freq.pt").is_file()
    assert_read_by_speculators_loaders(shared, out, 4)


def test_export_to_speculators_04_is_read_by_speculators_own_loaders(shared):
    """``speccompat export --to speculators-0.4`` of the driver's safetensors set: every sample, the
    side files speculators' own script writes, tensor-equal to the engine's states for its loaders."""
    out = shared.root / "exported-0.4"
    proc = subprocess.run([sys.executable, "-m", "speccompat", "export", str(shared.out), "--to", "speculators-0.4",
                           str(out)], capture_output=True, text=True, env=_env("0.4.0.1"), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    n = len(manifest(shared.out)[1])
    assert sorted(p.name for p in out.iterdir() if p.name.endswith("pt")) == sorted(f"data_{i}.pt" for i in range(n))
    assert (out / "data_config.json").is_file() and (out / "sample_lengths.json").is_file()
    assert_read_by_speculators_loaders(shared, out, n)


def assert_read_by_speculators_loaders(shared, out: Path, n: int) -> None:
    """``verify`` passes and speculators 0.3.0/0.4.0.1's own loaders read ``out``'s ``n`` samples as the
    engine's states in the shared run's safetensors files."""
    assert verify(out).returncode == 0
    _, entries = manifest(out)
    assert len(entries) == n
    import torch

    for version in ("0.3.0", "0.4.0.1"):
        if version not in ENGINE_ENV["speculators"]:
            continue
        r = subprocess.run([sys.executable, "-c", "import speccompat; speccompat.apply()\n" + LOADER, str(out)],
                           capture_output=True, text=True, env=_env(version), timeout=300, cwd=REPO)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(got) == n
        for sample_id, e in entries.items():
            ref, _ = load_sample(shared.file_of(sample_id))  # the same engine's safetensors file
            mask = ref["loss_mask"].tolist() if "loss_mask" in ref else [1] * len(ref["input_ids"])
            item = got[e["file"]]
            assert item["input_ids"] == ref["input_ids"].tolist()[1:] and item["loss_mask"] == mask[1:]
            hs = torch.cat([ref[f"hidden_states_{i}"] for i in LAYER_IDS[:-1]], dim=-1)[:-1].float().sum()
            assert item["hs_sum"] == pytest.approx(float(hs), rel=1e-5), (version, sample_id)
            last = ref[f"hidden_states_{LAYER_IDS[-1]}"][1:].float().sum()
            assert item["last_sum"] == pytest.approx(float(last), rel=1e-5), (version, sample_id)
