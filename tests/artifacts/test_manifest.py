"""Strict manifest decoding: types, unknown fields, format version, field paths in messages."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from megacore.artifacts import FORMAT_VERSION, decode_manifest, encode_manifest, json_schemas
from megacore.artifacts.run_spec import RunManifest
from megacore.errors import UserError

REPO = Path(__file__).resolve().parents[2]

RUN = {
    "kind": "run",
    "format_version": 1,
    "out": "run-out",
    "model": {"init": "ckpt"},
    "data": {"sources": [{"path": "tokens"}]},
    "batch": {"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 128},
    "train_steps": 10,
    "parallel": {"tp": 2, "pp": 1},
}


def _decode(doc: dict) -> object:
    return decode_manifest(json.dumps(doc).encode(), "run.json")


def test_valid_run_manifest_round_trips():
    m = _decode(RUN)
    assert isinstance(m, RunManifest)
    assert m.parallel.tp == 2 and m.optimizer.betas == [0.9, 0.95]
    again = decode_manifest(encode_manifest(m), "again")
    assert again == m


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"parallel": {"tp": "2"}}, "run.json: $.parallel.tp: expected int, got str"),
        ({"parallel": {"tp": 2, "tq": 1}}, "run.json: $.parallel: object contains unknown field tq"),
        ({"extra": True}, "run.json: $: object contains unknown field extra"),
        (
            {"batch": {"micro_batch_size": 2}},
            "run.json: $.batch: object missing required field global_batch_size",
        ),
        ({"format_version": FORMAT_VERSION + 1}, "is newer than this megacore supports"),
        ({"format_version": 0}, "$.format_version: 0 is not a valid version"),
        ({"kind": "weights"}, "$.kind: expected one of"),
        ({"precision": "fp4"}, "$.precision: invalid enum value 'fp4'"),
        # Every enum error lists what the field takes, found through the manifest's type.
        (
            {"parallel": {"schedule": "1f2b"}},
            '$.parallel.schedule: invalid enum value \'1f2b\'; choose one of "1f1b", "gpipe"',
        ),
        ({"data": {"sources": [{"path": "t"}], "loss_on": "me"}}, 'choose one of "all", "assistant"'),
        ({"compile": "yes"}, "$.compile: invalid enum value 'yes'; choose one of true, false, \"auto\""),
        (
            {
                "model": {
                    "config": {
                        "family": "gpt",
                        "vocab_size": 8,
                        "hidden_size": 8,
                        "num_layers": 1,
                        "num_heads": 1,
                        "num_kv_heads": 1,
                        "ffn_hidden_size": 8,
                    }
                }
            },
            '$.model.config.family: invalid enum value \'gpt\'; choose one of "deepseek_v3", "falcon", "gemma3"',
        ),
    ],
)
def test_bad_manifest_names_the_field(patch: dict, message: str):
    doc = {**RUN, **patch}
    with pytest.raises(UserError) as e:
        _decode(doc)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("given", "held"), [("fp32", "fp32"), ("float32", "fp32"), ("bf16", "bf16"), ("bfloat16", "bf16"),
                        ("fp16", "fp16"), ("float16", "fp16"), ("fp8", "fp8")],
)  # fmt: skip
def test_precision_takes_either_spelling_and_is_written_short(given: str, held: str):
    """The tools' --dtype spellings are a run's too; what is held and written is the short one, so
    a manifest written now reads in an older megacore; the schema accepts what the decoder does."""
    m = _decode({**RUN, "precision": given})
    assert m.precision == held
    assert json.loads(encode_manifest(m))["precision"] == held
    assert given in json_schemas()["run"]["$defs"]["RunManifest"]["properties"]["precision"]["enum"]


def test_wrong_kind_is_refused():
    with pytest.raises(UserError, match="expected a checkpoint artifact, found kind 'run'"):
        decode_manifest(json.dumps(RUN).encode(), "run.json", kind="checkpoint")


def test_not_json():
    with pytest.raises(UserError, match="run.json: not valid JSON"):
        decode_manifest(b'{"kind": ', "run.json")


def test_schemas_match_structs():
    """schemas/ is generated from the structs (`make schemas`); this fails when they drift."""
    for kind, schema in json_schemas().items():
        path = REPO / "schemas" / f"{kind}.schema.json"
        assert path.is_file(), f"{path} missing: run `make schemas`"
        on_disk = json.loads(path.read_text())
        assert on_disk == json.loads(json.dumps(schema)), f"{path} is stale: run `make schemas`"


def test_schema_agrees_with_decoder_on_unknown_fields():
    """The generated schema forbids what the decoder forbids (additionalProperties false)."""
    schema = json_schemas()["run"]
    run_def = schema["$defs"]["RunManifest"]
    assert run_def["additionalProperties"] is False
    assert set(run_def["required"]) >= {"kind", "format_version", "model", "data", "batch", "train_steps"}
    msgspec.json.decode(json.dumps(RUN).encode(), type=RunManifest)
