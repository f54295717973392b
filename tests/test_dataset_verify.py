"""`speccompat verify` (speccompat.dataset.verify): each planted problem reported, a loss mask
outside int8 per file, exit 2 for a manifest without a header."""

from __future__ import annotations

import json

import pytest
from support.dataset_fakes import jsonl, model_dir, random_records, states
from support.dataset_runs import manifest_entries, needs_torch, provenance, run, scan


@needs_torch
def test_verify_reports_each_planted_problem(world, capsys):
    from speccompat.cli import main as cli_main
    from speccompat.dataset import open_dataset, verify_dataset

    root, model, _data, samples = world
    out = root / "out"
    ds, _ = run(out, samples, provenance(model))
    assert cli_main(["verify", str(out)]) == 0
    f = {s.id: out / ds.files[s.id] for s in samples}
    f["s000"].unlink()                                                   # missing
    data = bytearray(f["s001"].read_bytes())
    data[-2:] = b"\x01\x02"
    f["s001"].write_bytes(bytes(data))                                   # checksum
    (out / "stray.bin").write_bytes(b"")                                 # extra
    (out / "x.safetensors.1.partial").write_bytes(b"")                   # leftover
    # a file of another provenance (and a NaN sample) written under the same manifest
    other = provenance(model)
    other["max_seq_len"] = 99
    ds2 = open_dataset(root / "out2", [samples[2]], other)
    w = ds2.writer()
    bad_states = states(samples[2])
    bad_states[0][0, 0] = float("nan")
    w.submit([ds2.job(samples[2], bad_states)])
    w.close()
    ds2.lock.close()
    (root / "out2" / ds2.files["s002"]).replace(f["s002"])
    entries = manifest_entries(root / "out2")
    with open(out / "manifest.jsonl", "a") as m:
        m.write(json.dumps(entries[0]) + "\n")
    problems, _ = verify_dataset(out)
    text = "\n".join(problems)
    for phrase in ["s000.safetensors: missing", "s001.safetensors: hidden_states_5 checksum differs",
                   "stray.bin: extra file", "x.safetensors.1.partial: extra file (temporary",
                   "s002.safetensors: hidden_states_1 has 1 non-finite", "s002.safetensors: provenance differs",
                   "max_seq_len"]:
        assert phrase in text, (phrase, text)
    assert len(problems) == 6, text
    assert cli_main(["verify", str(out)]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 6 and all(line.startswith(str(out)) for line in printed)


@needs_torch
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


@needs_torch
@pytest.mark.parametrize("manifest", [b"", b"\n\n", b'{"id": "x", "file": "x.safetensors"}\n', b"not json\n"])
def test_verify_exits_2_for_a_manifest_without_a_header(tmp_path, capsys, manifest):
    from speccompat.cli import main

    (tmp_path / "manifest.jsonl").write_bytes(manifest)
    assert main(["verify", str(tmp_path)]) == 2
    assert "Traceback" not in capsys.readouterr().err
