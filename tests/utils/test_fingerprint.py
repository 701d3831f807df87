"""A role's fingerprint names what it runs: the config it read and the model it loaded; a difference is named."""

from __future__ import annotations

from arl.utils.fingerprint import fingerprint_mismatch, run_fingerprint


def test_same_files_same_fingerprint_and_each_difference_is_named(tmp_path):
    cfg, model = tmp_path / "config.yaml", tmp_path / "model"
    model.mkdir()
    cfg.write_text("seed: 1\n")
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"\0" * 100)
    run = run_fingerprint(str(cfg), str(model))
    assert run == run_fingerprint(str(cfg), str(model)) and fingerprint_mismatch(run, dict(run)) == ""
    (model / "config.json").write_text('{"hidden_size": 128}')  # another model under the same path
    other = run_fingerprint(str(cfg), str(model))
    assert "the model it loaded" in fingerprint_mismatch(run, other)
    assert "config.yaml" not in fingerprint_mismatch(run, other)
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"\0" * 101)  # other weights: another size
    assert "the model it loaded" in fingerprint_mismatch(run, run_fingerprint(str(cfg), str(model)))
    (model / "model.safetensors").write_bytes(b"\0" * 100)
    cfg.write_text("seed: 2\n")  # config.yaml edited since the run started
    text = fingerprint_mismatch(run, run_fingerprint(str(cfg), str(model)))
    assert "config.yaml" in text and "model it loaded" not in text
    assert run_fingerprint(str(tmp_path / "missing.yaml"), str(model)) is None
    assert fingerprint_mismatch(None, run) == "" and fingerprint_mismatch(run, None) == ""  # unknown: not checked
