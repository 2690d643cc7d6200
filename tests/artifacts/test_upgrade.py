"""Format version 1 manifests read as today's (`megacore.artifacts.upgrade`): a mixture of experts'
training settings left the model config for the run (#50). The v1 manifests are the fixture an
earlier main wrote (tests/fixtures/e9be15e/) and that fixture's manifest turned into a mixture's
by hand, as a version 1 Mixtral checkpoint trained with a load-balancing weight records it."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mega_train.checkpoints import check_resumable
from megacore.artifacts import FORMAT_VERSION
from megacore.artifacts.codec import decode_manifest
from megacore.config import RouterLosses
from megacore.errors import UserError

TRAINED = Path(__file__).resolve().parents[1] / "fixtures" / "e9be15e" / "trained" / "manifest.json"
ROUTER = ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update")


def _v1_mixtral(aux: float) -> dict:
    raw = json.loads(TRAINED.read_text())
    raw["config"] |= {
        "family": "mixtral",
        "num_experts": 4,
        "experts_per_token": 2,
        "router_aux_loss_coef": aux,
    }
    return raw


def test_the_fixture_is_version_1_with_the_router_fields_in_its_config() -> None:
    raw = json.loads(TRAINED.read_text())
    assert raw["format_version"] == 1 < FORMAT_VERSION == 2
    assert {k: raw["config"][k] for k in ROUTER} == dict.fromkeys(ROUTER, 0.0)


def test_a_dense_v1_checkpoint_drops_its_zero_router_settings_and_keeps_its_fingerprint() -> None:
    raw = json.loads(TRAINED.read_text())
    m = decode_manifest(TRAINED.read_bytes(), "fixture", "checkpoint")
    encoded = json.loads(msgspec.json.encode(m.config))
    assert not set(ROUTER) & set(encoded)
    assert {k: v for k, v in encoded.items() if k in raw["config"]} == {
        k: v for k, v in raw["config"].items() if k not in ROUTER
    }
    assert m.training.fingerprint == raw["training"]["run"]  # nothing added for a dense model


def test_a_v1_mixtures_router_weight_moves_to_its_runs_fingerprint(tmp_path: Path) -> None:
    """The weight it trained with is what export reads and what a resume must keep: the same 0.02
    resumes, 0 (today's default) is refused naming the run manifest's field."""
    m = decode_manifest(json.dumps(_v1_mixtral(0.02)).encode(), "v1", "checkpoint")
    assert RouterLosses.from_fingerprint(m.training.fingerprint) == RouterLosses(aux_loss_coef=0.02)
    same = RouterLosses(aux_loss_coef=0.02).fingerprint()
    check_resumable(tmp_path, m, m.config, same, "run.json")
    with pytest.raises(UserError, match=r"^run\.json: \$\.model\.router_aux_loss_coef differs from the run"):
        check_resumable(tmp_path, m, m.config, RouterLosses().fingerprint(), "run.json")


def test_a_v1_run_manifest_sets_its_configs_router_weights_beside_it() -> None:
    run = {
        "kind": "run", "format_version": 1, "out": "run", "train_steps": 1,
        "model": {"config": _v1_mixtral(0.05)["config"], "router_z_loss_coef": None},
        "data": {"sources": [{"path": "tokens"}]},
        "batch": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 8},
    }  # fmt: skip
    m = decode_manifest(json.dumps(run).encode(), "run.json", "run")
    assert (m.model.router_aux_loss_coef, m.model.router_z_loss_coef, m.model.router_bias_update) == (
        0.05,
        0.0,
        0.0,
    )
    assert m.model.config.num_experts == 4
