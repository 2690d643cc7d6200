"""MXFP4 (gpt-oss's published experts): `models.mxfp4.dequantize` against transformers' own
`convert_moe_packed_tensors` and against the values an OCP MX v1.0 quantizer written here meant;
mega-convert's reader presenting each blocks + scales pair as the one tensor it stores; and the
refusal of every other quantization_config.

`quantize_mx` is for the end-to-end gpt-oss conversion test too: it turns a transformers parameter
into the two tensors a published checkpoint holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from helpers import assert_bitwise_equal, assert_one_line_error, run_in_process
from hf_cases import build
from mega_convert.convert import Packed, check_shapes, files_of, source_dtype, tensor_reader, weight_files
from megacore.errors import UserError
from megacore.models.mxfp4 import check_quantization, dequantize, packed_names

# OCP Microscaling Formats (MX) v1.0: E2M1 elements (emax_elem = 2, largest 6), E8M0 scales (bias
# 127), blocks of 32.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
EMAX_ELEM = 2
BLOCK = 32


def quantize_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) as MX codes: 4-bit E2M1 codes [..., K] and the E8M0 scale
    exponent (biased) of each block of 32 along the last dim [..., K/32], both int64."""
    x = x.double().unflatten(-1, (-1, BLOCK))
    amax = x.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1, exactly
    shared = torch.where(amax > 0, e - 1 - EMAX_ELEM, -127)  # an all-zero block: any scale; the least
    biased = (shared + 127).clamp(0, 254)  # 255 is E8M0's NaN
    a = x.abs() / torch.pow(2.0, (biased - 127).double()).unsqueeze(-1)
    # Round to the nearest E2M1 magnitude, ties to the even code; beyond 6 saturates to 6 (code 7).
    mids = (E2M1[1:] + E2M1[:-1]) / 2
    code = torch.bucketize(a.contiguous(), mids)  # a tie goes to the lower code here ...
    code = torch.where(torch.isin(a, mids) & (code % 2 == 1), code + 1, code)  # ... unless it is odd
    code = code | torch.where(x < 0, 8, 0)  # the sign bit
    return code.flatten(-2), biased


def decode_codes(code: torch.Tensor, biased: torch.Tensor) -> torch.Tensor:
    """The values MX codes and scales stand for, float64 (exact), [..., K]."""
    sign = torch.where(code >= 8, -1.0, 1.0).double()
    value = sign * E2M1[code & 7]
    return (value.unflatten(-1, (-1, BLOCK)) * torch.pow(2.0, (biased - 127).double()).unsqueeze(-1)).flatten(
        -2
    )


def pack(code: torch.Tensor, biased: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [E, rows, K] and exponents [E, rows, G] as a checkpoint stores them: blocks uint8
    [E, rows, G, 16] (two codes a byte, the even column in the low nibble) and scales uint8 [E, rows, G]."""
    byte = code[..., 0::2] | (code[..., 1::2] << 4)
    return byte.to(torch.uint8).unflatten(-1, (-1, BLOCK // 2)), biased.to(torch.uint8)


def quantize_mx(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A transformers gpt-oss expert parameter w [E, K, N] (gate_up_proj [E, hidden, 2*ffn],
    down_proj [E, ffn, hidden]; K a multiple of 32) as a published checkpoint stores it:
    (X_blocks [E, N, K/32, 16], X_scales [E, N, K/32], the values they stand for [E, K, N] float64)."""
    code, biased = quantize_codes(w.transpose(1, 2))
    blocks, scales = pack(code, biased)
    return blocks, scales, decode_codes(code, biased).transpose(1, 2).contiguous()


def weights(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values over many magnitudes (so many scales), with an all-zero block, a block of
    exact ties, and huge and tiny blocks that clamp the scale."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    blocks = w.unflatten(1, (-1, BLOCK))  # [E, K/32, 32, N]: a block is 32 consecutive rows of K
    blocks *= torch.pow(
        10.0, torch.empty(shape[0], blocks.shape[1], 1, shape[2]).uniform_(-4, 4, generator=g)
    )
    blocks[0, 0, :, 0] = 0.0
    blocks[0, 0, :, 1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4)  # amax 7: scale 2**0
    blocks[0, 0, :, 2] = 1e40  # beyond E8M0's largest scale: saturates at 6 * 2**127
    blocks[0, 0, :, 3] = 1e-40  # below its smallest: 2**-127, every value rounds to 0
    return w


def test_quantizer_follows_the_spec() -> None:
    """The test's own quantizer is MX: every value within half an E2M1 step of its input (but those
    above 6 * scale, which saturate), ties to the even code, the scale floor(log2(amax)) - 2."""
    w = weights((2, 64, 8), seed=1)
    code, biased = quantize_codes(w.transpose(1, 2))
    got = decode_codes(code, biased).transpose(1, 2)
    ties = code[0, 1, :8].tolist()  # 0.25, 0.75, ... under scale 2**0
    assert ties == [0, 2, 2, 4, 4, 6, 6, 7], ties  # 0, 1, 1, 2, 2, 4, 4, 6 (7 saturates)
    assert biased[0, 1, 0].item() == 127
    ordinary = torch.ones_like(w, dtype=torch.bool)
    ordinary[0, :BLOCK, :4] = False
    scale = torch.pow(2.0, (biased - 127).double()).repeat_interleave(BLOCK, -1).transpose(1, 2)
    err, inside = (got - w).abs()[ordinary], (w.abs() <= 6 * scale)[ordinary]
    assert torch.all(err[inside] <= scale[ordinary][inside])  # half the widest step, 4 -> 6
    assert torch.all(err[~inside] < 2 * scale[ordinary][~inside]) and (~inside).any()  # amax < 8 * scale
    assert torch.all(got[0, :BLOCK, 2] == 6 * 2.0**127) and torch.all(got[0, :BLOCK, 3] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_equals_transformers(dtype: torch.dtype) -> None:
    blocks, scales, meant = quantize_mx(weights((3, 96, 40), seed=2))
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3)
    ours = dequantize(blocks, scales, dtype)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == ref.shape == (3, 96, 40)
    assert torch.equal(ours, ref)
    assert torch.equal(ours, meant.to(dtype))  # every MX value is exact in bf16 (2-bit mantissas)
    # Chunked (a few rows at a time, across expert boundaries) gives the same bytes.
    assert_bitwise_equal(dequantize(blocks, scales, dtype, chunk=7 * 96), ours)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_every_byte_under_every_scale(dtype: torch.dtype) -> None:
    """Bit for bit transformers' result for all 256 bytes x all 256 scales, the overflowing, the
    subnormal and E8M0's NaN (255, which transformers takes for 2**128) included."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256).view(1, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).repeat_interleave(16).view(1, 256, 16)
    assert_bitwise_equal(
        dequantize(blocks, scales, dtype), convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    )


def test_bad_pairs_are_refused() -> None:
    blocks, scales, _ = quantize_mx(weights((1, 32, 4), seed=3))
    with pytest.raises(ValueError, match="not MXFP4"):
        dequantize(blocks, scales[:, :2], torch.bfloat16)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(blocks.int(), scales, torch.bfloat16)


def test_packed_names() -> None:
    names = ["a.gate_up_proj_blocks", "a.gate_up_proj_scales", "a.gate_up_proj_bias", "b_blocks", "norm"]
    assert packed_names(names) == {"a.gate_up_proj": ("a.gate_up_proj_blocks", "a.gate_up_proj_scales")}


GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"


def _published(d: Path) -> dict[str, torch.Tensor]:
    """A gpt-oss-like directory: MXFP4 experts (down_proj's blocks and scales in different files, as
    a sharded checkpoint may have them), an integer tensor before any float one, bf16 others;
    returns the tensors the reader should give."""
    d.mkdir()
    gate_up, down = weights((2, 64, 64), seed=4), weights((2, 32, 64), seed=5)  # hidden 64, ffn 32
    gu_blocks, gu_scales, gu = quantize_mx(gate_up)
    dn_blocks, dn_scales, dn = quantize_mx(down)
    norm = torch.randn(64).bfloat16()
    save_file(
        {f"{GATE_UP}_blocks": gu_blocks, f"{GATE_UP}_scales": gu_scales, f"{DOWN}_blocks": dn_blocks},
        str(d / "a.safetensors"),
    )
    save_file({"model.ids": torch.arange(4), f"{DOWN}_scales": dn_scales}, str(d / "b.safetensors"))
    save_file(
        {"model.norm.weight": norm, f"{GATE_UP}_bias": torch.zeros(2, 64).bfloat16()},
        str(d / "c.safetensors"),
    )
    return {GATE_UP: gu.bfloat16(), DOWN: dn.bfloat16(), "model.norm.weight": norm}


def test_reader_gives_the_dequantized_tensor(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    want = _published(d)
    where = weight_files(d, mxfp4_pairs=True)
    assert sorted(where) == sorted([GATE_UP, DOWN, f"{GATE_UP}_bias", "model.ids", "model.norm.weight"])
    assert where[DOWN] == Packed(f"{DOWN}_blocks", f"{DOWN}_scales", d / "a.safetensors", d / "b.safetensors")
    assert files_of(where) == [d / "a.safetensors", d / "b.safetensors", d / "c.safetensors"]
    # The first tensors are uint8 and int64: the checkpoint's dtype is its first float tensor's.
    assert source_dtype(where) == "bfloat16" and source_dtype(weight_files(d)) == "bfloat16"
    read = tensor_reader(where, d, source_dtype(where))
    for name, t in want.items():
        assert_bitwise_equal(read(name), t, name)
    assert read(GATE_UP).shape == (2, 64, 64) and read(DOWN).shape == (2, 32, 64)
    # Without the config's say-so the pairs stay two tensors each.
    assert f"{GATE_UP}_blocks" in weight_files(d) and GATE_UP not in weight_files(d)


def test_shape_checks_use_the_dequantized_shape(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    _published(d)
    where = weight_files(d, mxfp4_pairs=True)
    check_shapes({GATE_UP: (2, 64, 64), DOWN: (2, 32, 64), "model.norm.weight": (64,)}, where, d)
    # down_proj as stored, [E, hidden, ffn/32, 16], would be [2, 64, 32]: the check sees [2, 32, 64].
    with pytest.raises(UserError, match=r"down_proj: shape \[2, 32, 64\], config.json implies \[2, 64, 32\]"):
        check_shapes({DOWN: (2, 64, 32)}, where, d)
    with pytest.raises(UserError, match="gate_up_proj_blocks and .* are MXFP4, but config.json has no"):
        check_shapes({GATE_UP: (2, 64, 64)}, weight_files(d), d)
    raw = weight_files(d)
    del raw[f"{DOWN}_scales"]
    with pytest.raises(UserError, match=r"only .*down_proj_blocks of its MXFP4 pair is there"):
        tensor_reader(raw, d, "bfloat16")(DOWN)


def test_quantization_config() -> None:
    at = "hf/config.json"
    assert check_quantization({"model_type": "llama"}, at) is False
    mx = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    assert check_quantization({"model_type": "gpt_oss", "quantization_config": mx}, at) is True
    for hf in (
        {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}},
        {"model_type": "llama", "quantization_config": mx},
        {"model_type": "gpt_oss", "quantization_config": {"quant_method": ["mxfp4"]}},
    ):
        with pytest.raises(UserError) as e:
            check_quantization(hf, at)
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"{at}: $.quantization_config.quant_method: "), line
        assert (
            repr(hf["quantization_config"]["quant_method"]) in line
            and "'mxfp4' for model_type 'gpt_oss'" in line
        )
    with pytest.raises(UserError, match=r"\$.quantization_config: expected an object"):
        check_quantization({"model_type": "gpt_oss", "quantization_config": "mxfp4"}, at)


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_convert_refuses_other_quantization(method: str, tmp_path: Path) -> None:
    src = build("llama", tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (src / "config.json").write_text(json.dumps(config))
    p = run_in_process("mega-convert", "hf", src, tmp_path / "out")
    assert_one_line_error(
        p, "config.json: $.quantization_config.quant_method", repr(method), "(model_type 'llama')"
    )
    assert not (tmp_path / "out").exists()
