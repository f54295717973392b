"""The reader on every layout with a subset of layers; verify on a loss mask outside int8 and on a
manifest without a header; a token-frequency file inside the output directory is refused; two
builds of one Arrow view are byte-identical."""

from __future__ import annotations

import json
import os

import pytest
from support.dataset_fakes import LAYERS, jsonl, model_dir, random_records, states
from support.dataset_runs import provenance, run, scan

torch = pytest.importorskip("torch", reason="the data set's writer")


def write(root, layout, samples, model):
    from speccompat.dataset import open_dataset

    ds = open_dataset(root / layout, samples, provenance(model, layout=layout))
    with ds.writer(threads=2) as w:  # the files and the manifest (the .pt layout's side files need speculators)
        w.submit([ds.job(s, states(s)) for s in ds.todo])
    ds.close()
    if layout == "speculators-arrow":
        ds.finish()
    return root / layout


@pytest.mark.parametrize("layers", [[2, 5], [5, 1], [4], None])
def test_the_reader_returns_the_same_tensors_on_every_layout(tmp_path, layers):
    from speccompat.dataset.reader import HiddenStatesDataset

    model = model_dir(tmp_path)
    recs = random_records(4, seed=2)
    recs[1].pop("loss_mask")
    samples = scan(jsonl(tmp_path / "d.jsonl", recs))
    layouts = ["safetensors", "speculators"]
    try:
        import datasets  # noqa: F401

        layouts.append("speculators-arrow")
    except ImportError:
        pass
    want = layers if layers is not None else LAYERS
    for layout in layouts:
        d = write(tmp_path, layout, samples, model)
        rd = HiddenStatesDataset(d, layers=layers)
        assert len(rd) == len(samples), layout
        for k, s in enumerate(samples):
            item = rd[k]
            h = dict(zip(LAYERS, states(s), strict=True))
            assert item["id"] == s.id and item["input_ids"].tolist() == list(s.input_ids), layout
            assert item["layer_ids"] == want and item["vllm_aux_ids"] == [i + 1 for i in want]
            assert len(item["hidden_states"]) == len(want), layout
            for i, t in zip(want, item["hidden_states"], strict=True):
                assert torch.equal(t, h[i]), (layout, i)


def test_verify_reports_a_loss_mask_outside_int8_per_file(tmp_path, capsys):
    """A loss_mask value of 200 (int64 in the file, checksums made to agree) is one line naming the
    file, exit 1: no traceback."""
    from speccompat.cli import main
    from speccompat.dataset.checksum import digest_fn
    from speccompat.dataset.formats import read_safetensors

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(3, seed=1)))
    out = tmp_path / "out"
    ds, _ = run(out, samples, provenance(model))
    victim = out / ds.files[samples[1].id]
    raw = bytearray(victim.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    lo = 8 + n + header["loss_mask"]["data_offsets"][0]
    raw[lo:lo + 8] = (200).to_bytes(8, "little")
    victim.write_bytes(bytes(raw))
    lines = (out / "manifest.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    digest = digest_fn(head["checksum"])
    _meta, tensors, _mm = read_safetensors(victim)
    for k, line in enumerate(lines[1:], start=1):
        e = json.loads(line)
        if e["file"] == victim.name:
            e["tensors"]["loss_mask"]["checksum"] = digest(tensors["loss_mask"][2])
            lines[k] = json.dumps(e)
    (out / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["verify", str(out)]) == 1
    printed = capsys.readouterr()
    assert printed.out.splitlines() == [f"{victim}: input_ids/loss_mask do not hash to the manifest's input_sha256"]
    assert "Traceback" not in printed.err


@pytest.mark.parametrize("manifest", [b"", b"\n\n", b'{"id": "x", "file": "x.safetensors"}\n', b"not json\n"])
def test_verify_exits_2_for_a_manifest_without_a_header(tmp_path, capsys, manifest):
    from speccompat.cli import main

    (tmp_path / "manifest.jsonl").write_bytes(manifest)
    assert main(["verify", str(tmp_path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_token_frequency_file_inside_the_output_directory_is_refused(tmp_path, monkeypatch, caplog):
    from speccompat.cli import main
    from speccompat.dataset import extract as ex

    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(3))
    out = tmp_path / "out"
    monkeypatch.setattr(ex, "start_generator", lambda *a: pytest.fail("the engine must not start"))
    for inside in (out / "token_freq.pt", out / "sub" / "f.pt", out):
        caplog.clear()
        code = ex.main(["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
                        "--format", "speculators", "--layer-ids", "1", "2", "4", "5", "--token-freq-path",
                        str(inside)])
        assert code == 2 and not out.exists(), inside
        assert "is inside the output directory" in caplog.text
    os.symlink(tmp_path, tmp_path / "via")  # the same place through a link
    out.mkdir()
    assert main(["merge", str(out), "--token-freq-path", str(tmp_path / "via" / "out" / "f.pt")]) == 2
    assert sorted(os.listdir(out)) == []
    beside = ex.ExtractConfig(model_path=str(model), prepared_data=data, output_dir=out, layout="speculators",
                              layer_ids=[1, 2, 4, 5], token_freq_path=tmp_path / "out.freq.pt")
    assert ex.check_settings(beside)[1] == [1, 2, 4, 5]  # beside the directory: accepted


def test_two_builds_of_one_arrow_view_are_byte_identical(tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="the speculators-arrow layout")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(5, seed=6)))
    for name in ("a", "b"):
        run(tmp_path / name, samples, provenance(model, layout="speculators-arrow"), batch=2)

    def files(d):
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
                and not p.name.endswith(".lock")}

    a, b = files(tmp_path / "a"), files(tmp_path / "b")
    assert sorted(a) == sorted(b) and "state.json" in a
    assert [k for k in a if a[k] != b[k]] == []
