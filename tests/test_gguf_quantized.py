"""A GGUF's Q8_0 / Q4_0 / Q4_1 blocks as kvkernels' QuantizedWeight (worker/model/gguf_loader.py), held value by
value to gguf-py's dequantisation, and the rules that turn them into the format `--weights` asks for."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvkernels.weight_only import QuantizedWeight, dequantize
from kvroute.gguf_file import GGUFFile, read_gguf
from kvroute.model_source import smollm2_gguf_path
from worker.model.gguf_loader import gguf_quantized_weight, unpermute_qk, unpermute_qk_weight
from worker.model.weight_quantization import WeightQuantization, to_quantized

Q = gguf.GGMLQuantizationType


def reference(tensor) -> np.ndarray:
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape)))


@pytest.fixture(scope="module")
def smollm2() -> GGUFFile:
    return read_gguf(smollm2_gguf_path())


def test_smollm2s_q4_1_and_q8_0_blocks_unpack_to_gguf_pys_numbers(smollm2: GGUFFile) -> None:
    tensors = {t.name: t for t in smollm2.tensors}
    names = ["token_embd.weight"] + [f"blk.{i}.{n}.weight" for i in (0, 29) for n in ("attn_q", "ffn_down")]
    for name in names:
        tensor = tensors[name]
        weight = gguf_quantized_weight(tensor)
        assert weight is not None, name
        assert (weight.bits, weight.group_size) == ((8, 32) if tensor.tensor_type == Q.Q8_0 else (4, 32)), name
        assert np.array_equal(dequantize(weight).numpy(), reference(tensor)), name
    assert {tensors[n].tensor_type for n in names} == {Q.Q8_0, Q.Q4_1}
    assert gguf_quantized_weight(tensors["blk.0.attn_norm.weight"]) is None  # F32: not a block format


def test_the_q_k_row_permutation_moves_quantized_rows_as_it_moves_float_ones(smollm2: GGUFFile) -> None:
    tensor = next(t for t in smollm2.tensors if t.name == "blk.3.attn_k.weight")
    weight = gguf_quantized_weight(tensor)
    assert weight is not None
    unpermuted = unpermute_qk_weight(weight, n_head=3)  # SmolLM2's 3 KV heads
    assert np.array_equal(dequantize(unpermuted).numpy(), unpermute_qk(reference(tensor), 3))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_blocks_gguf_py_quantized_and_wrote_unpack_to_its_numbers(tmp_path, qtype) -> None:
    rng = np.random.default_rng(int(qtype))
    floats = rng.normal(0, 0.05, size=(48, 96)).astype(np.float32)
    floats[0] = 0  # an all-zero block (scale 0)
    floats[1, :32] = -np.abs(floats[1, :32])  # a block of one sign
    floats[2, 32:64] *= 1000  # a large one
    path = tmp_path / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(floats, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFFile(path).tensors
    assert tensor.tensor_type == qtype
    weight = gguf_quantized_weight(tensor)
    assert weight is not None and weight.shape == (48, 96)
    assert np.array_equal(dequantize(weight).numpy(), reference(tensor))


def test_int8_asked_of_4_bit_blocks_is_the_same_numbers(smollm2: GGUFFile) -> None:
    tensor = next(t for t in smollm2.tensors if t.name == "blk.0.ffn_gate.weight")
    blocks = gguf_quantized_weight(tensor)
    assert blocks is not None and blocks.bits == 4
    int8 = to_quantized(blocks, WeightQuantization(8, None, False), float_group=64)
    assert (int8.bits, int8.group_size, int8.q.dtype) == (8, 32, torch.int8)
    assert torch.equal(dequantize(int8), dequantize(blocks))


def test_int4_asked_of_q8_0_blocks_keeps_int8_unless_a_group_size_is_asked(smollm2: GGUFFile) -> None:
    rows = torch.arange(0, 49152, 97)  # a slice of token_embd: enough to tell
    table = gguf_quantized_weight(next(t for t in smollm2.tensors if t.name == "token_embd.weight"))
    assert table is not None and table.bits == 8
    q8 = QuantizedWeight(8, 32, table.q[rows], table.scales[rows], table.offsets[rows])
    assert to_quantized(q8, WeightQuantization(4, None, False), float_group=64) is q8
    for group in (32, 64):
        int4 = to_quantized(q8, WeightQuantization(4, group, True), float_group=64)
        assert (int4.bits, int4.group_size) == (4, group)
        error = (dequantize(int4) - dequantize(q8)).abs().max().item()
        assert 0 < error <= dequantize(q8).abs().max().item() / 7  # rounded to 4 bits: half a step at most
