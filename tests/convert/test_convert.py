"""mega-convert: HF dir -> checkpoint artifact (streaming), verify, round trip back to HF, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers import assert_bitwise_equal, assert_one_line_error, load_decoder, run_in_process
from hf_cases import CASES, attention_impl, build, load_hf, tokens
from mega_convert.convert import WEIGHTS, convert_hf
from mega_convert.verify import verify
from mega_export.export import export_hf
from megacore.artifacts import MANIFEST_NAME, open_artifact, sha256_file
from megacore.artifacts.manifest import HFSource, License
from megacore.artifacts.pieces import safetensors_layout
from megacore.config_parts import ParallelBlockSpec
from megacore.errors import UserError


def quiet(msg: str) -> None:
    pass


def _tokenizer_files(model_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))


@pytest.mark.parametrize("case", list(CASES))
def test_convert_verify_and_round_trip_bit_exact(case: str, tmp_path: Path) -> None:
    src = build(case, tmp_path / "hf")
    _tokenizer_files(src)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    s = convert_hf(src, ckpt, log=quiet)
    m = open_artifact(ckpt, "checkpoint")
    assert m.layout.tp == 1 and m.layout.pp == 1
    assert m.layout.stage_layers == [list(range(m.config.num_layers))]
    assert m.config.padded_vocab_size % 128 == 0 and s["padded_vocab_size"] == m.config.padded_vocab_size
    assert "tokenizer/tokenizer.json" in m.tokenizer_files and (ckpt / "tokenizer/tokenizer.json").is_file()
    assert torch.all(load_decoder(ckpt).embed.weight[m.config.vocab_size :] == 0)

    r = verify(ckpt, src, seq_len=CASES[case][2])
    assert r["passed"] and r["max_abs_error"] < 1e-4, r

    export_hf(ckpt, back)
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert_bitwise_equal(a[k], b[k], k)
    assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # The exported config.json (classic rope form) gives transformers the same model, every weight
    # in its place: the source's architecture (Qwen2ForCausalLM stays one, not a Llama).
    exported, info = AutoModelForCausalLM.from_pretrained(
        back,
        attn_implementation=attention_impl(json.loads((back / "config.json").read_text())),
        output_loading_info=True,
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    original = load_hf(src)
    assert type(exported) is type(original), (type(exported), type(original))
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == original.config.model_type
    assert config["architectures"] == [type(original).__name__]
    ids = tokens(original.config.vocab_size, 16)
    with torch.no_grad():
        assert torch.equal(exported.eval()(ids).logits, original(ids).logits)


def test_bf16_round_trip_and_dtype_option(tmp_path: Path) -> None:
    src = build("llama2-70b-gqa", tmp_path / "hf", dtype=torch.bfloat16)
    convert_hf(src, tmp_path / "bf16", log=quiet)
    assert open_artifact(tmp_path / "bf16", "checkpoint").dtype == "bfloat16"
    export_hf(tmp_path / "bf16", tmp_path / "back")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    for k in a:
        assert b[k].dtype == torch.bfloat16
        assert_bitwise_equal(a[k], b[k], k)
    convert_hf(src, tmp_path / "fp32", dtype="float32", log=quiet)
    m = open_artifact(tmp_path / "fp32", "checkpoint")
    assert m.dtype == "float32" and all(e.dtype == "float32" for e in m.tensors.values())


def test_sharded_hf_checkpoint(tmp_path: Path) -> None:
    """model.safetensors.index.json + several shards convert to the same tensors as one file."""
    from transformers import AutoModelForCausalLM

    src = build("falcon-40b", tmp_path / "one")
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "many", max_shard_size="40KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
    convert_hf(src, tmp_path / "c1", log=quiet)
    convert_hf(tmp_path / "many", tmp_path / "c2", log=quiet)
    a, b = load_file(tmp_path / "c1" / WEIGHTS), load_file(tmp_path / "c2" / WEIGHTS)
    assert sorted(a) == sorted(b)
    for k in a:
        assert_bitwise_equal(a[k], b[k], k)
    # and the export direction shards too
    export_hf(tmp_path / "c2", tmp_path / "back", max_shard_bytes=40_000)
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    ids = tokens(90, 12)
    with torch.no_grad():
        assert torch.equal(load_hf(tmp_path / "back")(ids).logits, load_hf(src)(ids).logits)


def test_cli_convert_reuse_force_and_verify(tmp_path: Path) -> None:
    src = build("mistral-window", tmp_path / "hf")
    out = tmp_path / "ckpt"
    p = run_in_process("mega-convert", "hf", src, out, "--json", check=True)
    s = json.loads(p.stdout)
    assert s["family"] == "mistral" and not s["reused"] and s["padded_vocab_size"] == 128
    # Where it came from: a directory that is no Hub cache snapshot, by its absolute path alone.
    assert open_artifact(out, "checkpoint").hf_source == HFSource(path=str(src.resolve()))
    p = run_in_process("mega-convert", "hf", src, out, "--json", check=True)
    assert json.loads(p.stdout)["reused"] and "reusing" in p.stderr
    p = run_in_process("mega-convert", "hf", src, out, "--force", "--json", check=True)
    assert not json.loads(p.stdout)["reused"]
    p = run_in_process("mega-convert", "verify", out, src, "--seq-len", "24")
    assert p.returncode == 0 and "PASS" in p.stdout, p.stderr
    # Tamper with one weight (same file size): the file no longer matches its sha256, exit 2.
    _overwrite_first_value(out / WEIGHTS, "layers.1.mlp.down_proj.weight", 1.5)
    p = run_in_process("mega-convert", "verify", out, src, "--seq-len", "24", "--json")
    down = "layers.1.mlp.down_proj.weight"
    assert_one_line_error(p, f"{WEIGHTS}: damaged (sha256 of tensor {down!r} differs from the manifest)")
    # The same weight in a manifest that agrees (as a faulty converter would write it, the file's
    # and the piece's sums): verify reports the logit error and exits 1.
    doc = json.loads((out / MANIFEST_NAME).read_text())
    next(e for e in doc["files"] if e["path"] == WEIGHTS)["sha256"] = sha256_file(out / WEIGHTS)
    start, header = safetensors_layout(out / WEIGHTS)
    span = (start + header[down]["data_offsets"][0], start + header[down]["data_offsets"][1])
    doc["tensors"][down]["pieces"][0]["sha256"] = sha256_file(out / WEIGHTS, span=span)
    (out / MANIFEST_NAME).write_text(json.dumps(doc))
    p = run_in_process("mega-convert", "verify", out, src, "--seq-len", "24", "--json")
    r = json.loads(p.stdout)
    assert p.returncode == 1 and not r["passed"] and r["max_abs_error"] > 1e-3


def test_bf16_conversion_verifies_in_bf16(tmp_path: Path) -> None:
    """`--dtype bf16` is `--dtype bfloat16` (the same recipe: reused). verify compares in the
    checkpoint's dtype with that dtype's tolerance unless --dtype says otherwise, and says which: in
    float32 the bf16 rounding of the weights alone is above fp32's bar."""
    src = build("llama2-70b-gqa", tmp_path / "hf")  # float32 weights
    out = tmp_path / "ckpt"
    p = run_in_process("mega-convert", "hf", src, out, "--dtype", "bf16", "--json", check=True)
    assert json.loads(p.stdout)["dtype"] == "bfloat16" == open_artifact(out, "checkpoint").dtype
    p = run_in_process("mega-convert", "hf", src, out, "--dtype", "bfloat16", "--json", check=True)
    assert json.loads(p.stdout)["reused"]
    p = run_in_process("mega-convert", "verify", out, src, "--seq-len", "24")
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "compared in bfloat16, the checkpoint's dtype:" in p.stdout and "(tolerance 1)" in p.stdout
    assert p.stdout.rstrip().endswith("PASS"), p.stdout
    p = run_in_process("mega-convert", "verify", out, src, "--seq-len", "24", "--dtype", "fp32", "--json")
    r = json.loads(p.stdout)
    assert (r["dtype"], r["dtype_from"], r["tolerance"]) == ("float32", "from --dtype", 1e-4), r
    assert p.returncode == 1 and not r["passed"] and r["max_abs_error"] > 1e-4


def _overwrite_first_value(path: Path, key: str, value: float) -> None:
    """Change one float32 in place, keeping the file size (a silent corruption the size check misses)."""
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start = json.loads(f.read(n))[key]["data_offsets"][0]
        f.seek(8 + n + start)
        f.write(struct.pack("<f", value))


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_bad_inputs_exit_2_one_line(tmp_path: Path) -> None:
    """The command line (run in this process): exit 2, one line naming what is wrong, nothing left behind."""
    (tmp_path / "empty").mkdir()
    assert_one_line_error(
        run_in_process("mega-convert", "hf", tmp_path / "empty", tmp_path / "o1"), "no config.json"
    )

    unknown = build("llama", tmp_path / "gpt")
    _edit_config(unknown, model_type="gpt2")
    assert_one_line_error(
        run_in_process("mega-convert", "hf", unknown, tmp_path / "o2"), "model_type", "gpt2"
    )

    missing = build("llama", tmp_path / "missing")
    state = load_file(missing / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, missing / "model.safetensors")
    assert_one_line_error(
        run_in_process("mega-convert", "hf", missing, tmp_path / "o3"),
        "model.layers.1.mlp.up_proj.weight",
        "missing",
    )

    bad_card = build("llama", tmp_path / "card")
    (bad_card / "README.md").write_text("---\nlicense: [apache-2.0\n---\n# a model\n")
    assert_one_line_error(
        run_in_process("mega-convert", "hf", bad_card, tmp_path / "o4"),
        "README.md",
        "front matter is not valid YAML",
    )
    for i in range(1, 5):
        assert not (tmp_path / f"o{i}").exists() and not (tmp_path / f"o{i}.partial").exists()


def test_license_is_read_from_the_model_card(tmp_path: Path) -> None:
    """The card's front matter gives the license (as the Hub reads it); no card, or no license in
    it: none. The card is part of the recipe: after an edit the old conversion is not reused."""
    src = build("llama", tmp_path / "hf")
    convert_hf(src, tmp_path / "none", log=quiet)
    assert open_artifact(tmp_path / "none", "checkpoint").license is None
    (src / "README.md").write_text("# no front matter\n")
    assert convert_hf(src, tmp_path / "plain", log=quiet)["license"] is None
    (src / "README.md").write_text(
        "---\nlicense: other\nlicense_name: tiny\nlicense_link: LICENSE\n---\n# a model\n"
    )
    s = convert_hf(src, tmp_path / "other", log=quiet)
    assert s["license"] == "other"
    assert open_artifact(tmp_path / "other", "checkpoint").license == License("other", "tiny", "LICENSE")
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    with pytest.raises(UserError, match="--force"):
        convert_hf(src, tmp_path / "other", log=quiet)
    convert_hf(src, tmp_path / "other", log=quiet, force=True)
    assert open_artifact(tmp_path / "other", "checkpoint").license == License("apache-2.0")
    assert convert_hf(src, tmp_path / "other", log=quiet)["reused"] is True


def _pickled(tmp_path: Path) -> Path:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((build("llama", tmp_path / "src") / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    return pickled


BAD = {
    "shape": ("llama", {"intermediate_size": 80}, "model.layers.0.mlp.gate_proj.weight: shape [96, 64]"),
    "kv heads": ("llama", {"num_key_value_heads": 3}, "not a multiple of the kv heads 3"),
    "alibi": ("falcon-7b", {"alibi": True}, "ALiBi"),
    "rope type": (
        "llama",
        {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
        "'longrope' is not supported",
    ),
    # A yarn key transformers' yarn does not read (Ministral 3's) would change the model unseen.
    "yarn key": (
        "llama",
        {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "llama_4_scaling_beta": 0.1}},
        "$.rope_parameters.llama_4_scaling_beta: not supported in yarn rope scaling",
    ),
    "missing size": ("llama", {"hidden_size": None}, "$.hidden_size"),
    "activation": ("llama", {"hidden_act": "gelu"}, "$.hidden_act"),
    # One window for every layer or none: Qwen's window on some layers only is refused.
    "qwen window": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention"],
        },
        "a sliding window on 1 of 2 layers cannot be expressed",
    ),
}


@pytest.mark.parametrize("what", [*BAD, "pickle"])
def test_bad_inputs_are_user_errors(what: str, tmp_path: Path) -> None:
    if what == "pickle":
        src, fragment = _pickled(tmp_path), "safetensors only"
    else:
        case, changes, fragment = BAD[what]
        src = build(case, tmp_path / "hf")
        _edit_config(src, **changes)
    with pytest.raises(UserError) as e:
        convert_hf(src, tmp_path / "out", log=quiet)
    assert fragment in str(e.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_early_falcon_config_names(tmp_path: Path) -> None:
    """Falcon-7B's first config.json (model_type RefinedWebModel, n_head / n_layer) converts the same."""
    src = build("falcon-7b", tmp_path / "new")
    convert_hf(src, tmp_path / "c_new", log=quiet)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "RefinedWebModel"
    cfg["n_head"], cfg["n_layer"] = cfg.pop("num_attention_heads"), cfg.pop("num_hidden_layers")
    (src / "config.json").write_text(json.dumps(cfg))
    convert_hf(src, tmp_path / "c_old", log=quiet)
    a, b = open_artifact(tmp_path / "c_new", "checkpoint"), open_artifact(tmp_path / "c_old", "checkpoint")
    assert (
        a.config == b.config and a.config.num_kv_heads == 1 and a.config.block == ParallelBlockSpec(norms=1)
    )
    ta, tb = load_file(tmp_path / "c_new" / WEIGHTS), load_file(tmp_path / "c_old" / WEIGHTS)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert_bitwise_equal(ta[k], tb[k], k)


def test_deepseek_v3s_multi_token_prediction_layer_is_left_out_in_one_line(tmp_path: Path) -> None:
    """The published DeepSeek V3 checkpoints carry a multi-token-prediction layer after the last
    (`model.layers.<num_hidden_layers>`): convert leaves its tensors out saying so in one line, the
    model verifies, and the export says it has none (`num_nextn_predict_layers` 0)."""
    hf = build("deepseek-v3", tmp_path / "hf")
    state = load_file(hf / "model.safetensors")
    state["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer's own, as published
    state["model.layers.4.enorm.weight"] = torch.ones(64)
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    _edit_config(hf, num_nextn_predict_layers=1)
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exported"
    converted = run_in_process("mega-convert", "hf", hf, ckpt, check=True)
    line = "mega-convert: the multi-token-prediction layer 4 (2 tensors) left out: it is not trained here"
    assert line in converted.stderr, converted.stderr
    assert run_in_process("mega-convert", "verify", ckpt, hf, check=True).stdout.rstrip().endswith("PASS")
    run_in_process("mega-export", ckpt, exported, check=True)
    assert json.loads((exported / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_deepseek_v3_configs_the_decoder_cannot_build_exit_2(tmp_path: Path) -> None:
    """Latent attention with an odd number of rotated dims, expert groups that do not divide the
    experts: one line naming the field, exit 2, nothing written."""
    for i, (change, field) in enumerate(
        [
            ({"qk_rope_head_dim": 7}, "qk_rope_head_dim 7 must be even"),
            ({"n_group": 3}, "router groups 3 must divide"),
        ]
    ):
        hf = build("deepseek-v3", tmp_path / f"hf{i}")
        _edit_config(hf, **change)
        assert_one_line_error(run_in_process("mega-convert", "hf", hf, tmp_path / f"o{i}"), field)
        assert not (tmp_path / f"o{i}").exists()


def test_qwen3_5s_language_model_is_read_from_its_multimodal_checkpoint(tmp_path: Path) -> None:
    """The published Qwen 3.5 checkpoints are Qwen3_5ForConditionalGeneration (model_type qwen3_5,
    the language model's config in text_config, its tensors under model.language_model.) with a
    multi-token-prediction module: convert reads the language model and says in one line what it
    leaves out, verify passes against the multimodal directory (transformers loads its language
    model), and the export is a Qwen3_5ForCausalLM holding the language model's tensors bit for bit."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen3_5 import Qwen3_5Config

    text = {
        **CASES["qwen3.5"][1],
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
    }
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    hf = tmp_path / "hf"
    AutoModelForImageTextToText.from_config(
        Qwen3_5Config(text_config=text, vision_config=vision)
    ).save_pretrained(hf)
    state = load_file(hf / "model.safetensors")
    state["mtp.fc.weight"] = torch.zeros(64, 128)  # as published: the MTP module beside the model
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exported"
    converted = run_in_process("mega-convert", "hf", hf, ckpt, check=True)
    visual = sum(n.startswith("model.visual.") for n in state)
    line = (
        f"mega-convert: the vision encoder ({visual} tensors) and the multi-token-prediction module (1 tensor) "
        "left out: the language model is converted, and export writes it alone"
    )
    assert line in converted.stderr.splitlines(), converted.stderr
    assert run_in_process("mega-convert", "verify", ckpt, hf, check=True).stdout.rstrip().endswith("PASS")
    run_in_process("mega-export", ckpt, exported, check=True)
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    written = load_file(exported / "model.safetensors")
    language = {
        n.replace("model.language_model.", "model."): t for n, t in state.items() if "language_model" in n
    }
    assert sorted(written) == sorted([*language, "lm_head.weight"])
    for name, t in written.items():
        assert_bitwise_equal(t, state[name] if name == "lm_head.weight" else language[name], name)
