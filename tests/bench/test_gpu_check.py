"""bench.gpu_check's cut model and its agreement figure, which the GPU run is judged by."""

from __future__ import annotations

import gguf
import numpy as np

from bench.gpu_check import agreement, cut_gguf


def _write(path, tensors: dict[str, np.ndarray], block_count: int) -> None:
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_block_count(block_count)
    writer.add_token_list(["<s>", "</s>", "a", "b"])
    writer.add_chat_template("{{ messages }}")
    for name, data in tensors.items():
        if name.endswith("ffn_down.weight"):  # a quantized tensor travels as its raw blocks
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_cut_gguf_keeps_the_first_layers_byte_for_byte(tmp_path):
    rng = np.random.default_rng(0)
    names = ["token_embd.weight", "output_norm.weight"]
    names += [f"blk.{i}.{w}.weight" for i in range(3) for w in ("attn_q", "ffn_down")]
    tensors = {name: rng.standard_normal((4, 64), np.float32) for name in names}
    _write(tmp_path / "whole.gguf", tensors, block_count=3)
    cut_gguf(tmp_path / "whole.gguf", tmp_path / "cut.gguf", layers=2)
    whole, part = gguf.GGUFReader(tmp_path / "whole.gguf"), gguf.GGUFReader(tmp_path / "cut.gguf")
    assert part.fields["llama.block_count"].contents() == 2
    kept = {t.name: t for t in whole.tensors if not t.name.startswith("blk.2.")}
    assert {t.name for t in part.tensors} == set(kept) and len(kept) == 6
    for tensor in part.tensors:
        assert tensor.tensor_type == kept[tensor.name].tensor_type
        np.testing.assert_array_equal(tensor.data, kept[tensor.name].data)
    for name in ("tokenizer.ggml.tokens", "tokenizer.chat_template"):
        assert part.fields[name].contents() == whole.fields[name].contents()


def test_agreement_counts_tokens_before_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    tokens = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]
    assert agreement(tokens, reference) == {
        "prefix_agreement": (4 + 1 + 0) / 12,
        "identical_sequences": 1,
    }
