"""jserve's Tokenizer against transformers: ids, decoding, special tokens, save/reload, errors."""

from __future__ import annotations

import asyncio
import json
import re
import time

import gguf
import pytest

from jserve.loaders.gguf_tokenizer import byte_to_unicode
from jserve.loaders.tokenizer import Tokenizer

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. Don't, can't, we'll, I'm, they've.",
    "1 12 123 1234 12345678901234567890 3.14159 -42 1e-5 0x1F 2024-06-01",
    "a  1 b   22\t3\n4  \t 5",
    "spaces:     end   ",
    "   leading spaces",
    "tabs\tand\t\ttabs\n\nnewlines\r\n\r\nwindows\n",
    "你好，世界！这是一个测试。日本語のテキスト。한국어 텍스트.",
    "emoji 😀👍🏽🇫🇷👨‍👩‍👧 and ❤️ mixed",
    "Ünïcödé àccents, ß, Ω, Привет мир, مرحبا بالعالم",
    'def f(x):\n    return {"a": [1, 2, 3], "b": x ** 2}  # comment\n',
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\n\tif (x != y) return -1;",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<|im_start|><|im_end|><|endoftext|><repo_name><file_sep>text<|im_end|>",
    "not special: <|im_start |> <im_end> <|endoftext",
    "\x00 control \x1b[0m chars \u200b zero width",
]

# Where transformers' GGUF tokenizer (plain GPT-2 splitting) and SmolLM2's (digits first) differ.
WHITESPACE_RUN_BEFORE_DIGIT = re.compile(r"\s{2,}\d")


@pytest.mark.parametrize("text", CORPUS)
def test_ids_and_decoding_match_transformers(text, smollm2_tokenizer, hf_smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(text)
    assert ids == hf_smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text  # byte-level: lossless
    for skip in (True, False):
        expected = hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=skip) == expected
    spellings = [smollm2_tokenizer.backend.id_to_token(i) for i in ids]
    assert spellings == hf_smollm2_tokenizer.convert_ids_to_tokens(ids)


def test_transformers_gguf_differs_only_on_whitespace_runs_before_digits(
    smollm2_tokenizer, hf_gguf_tokenizer
):
    for text in CORPUS:
        ours, theirs = smollm2_tokenizer.encode(text), hf_gguf_tokenizer.encode(text)
        assert (ours != theirs) == bool(WHITESPACE_RUN_BEFORE_DIGIT.search(text)), text
    # SmolLM2 / llama.cpp "smollm": "a", "  ", "1" -> [a, ĠĠ, 1]; GPT-2 splitting: [a, Ġ, Ġ, 1].
    assert smollm2_tokenizer.encode("a  1") == [81, 256, 33]
    assert smollm2_tokenizer.backend.id_to_token(256) == "ĠĠ"
    assert hf_gguf_tokenizer.encode("a  1") == [81, 216, 216, 33]


def test_special_tokens_and_stop_ids(smollm2_tokenizer, hf_gguf_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab_size == len(hf_gguf_tokenizer) == 49152
    assert (
        (tok.bos_token_id, tok.bos_token)
        == (1, "<|im_start|>")
        == (
            hf_gguf_tokenizer.bos_token_id,
            hf_gguf_tokenizer.bos_token,
        )
    )
    assert (
        (tok.eos_token_id, tok.eos_token)
        == (2, "<|im_end|>")
        == (
            hf_gguf_tokenizer.eos_token_id,
            hf_gguf_tokenizer.eos_token,
        )
    )
    assert tok.stop_token_ids == {0, 2}  # <|endoftext|> ends a document, <|im_end|> a turn
    assert tok.add_bos is False
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)
    assert tok.encode("<|im_start|>user")[0] == 1
    assert tok.backend.token_to_id("<|im_end|>") == 2
    assert tok.decode([1, 19556, 2, 0]) == "Hello"


def test_save_and_reload_round_trip(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save(tmp_path)
    reloaded = Tokenizer.from_pretrained_dir(tmp_path)
    for text in CORPUS:
        assert reloaded.encode(text) == smollm2_tokenizer.encode(text)
    for attr in ("vocab_size", "bos_token_id", "eos_token_id", "stop_token_ids", "add_bos"):
        assert getattr(reloaded, attr) == getattr(smollm2_tokenizer, attr), attr
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert reloaded.apply_chat_template(messages) == smollm2_tokenizer.apply_chat_template(messages)


def test_saved_directory_loads_in_transformers(smollm2_tokenizer, hf_smollm2_tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    smollm2_tokenizer.save(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in CORPUS:
        assert theirs.encode(text) == hf_smollm2_tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        smollm2_tokenizer.apply_chat_template(messages)
    )


def test_transformers_saved_directory_matches_transformers(hf_gguf_tokenizer, tmp_path):
    hf_gguf_tokenizer.save_pretrained(tmp_path)  # writes chat_template.jinja separately
    ours = Tokenizer.from_pretrained_dir(tmp_path)
    for text in CORPUS:
        assert ours.encode(text) == hf_gguf_tokenizer.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert ours.chat_template == hf_gguf_tokenizer.chat_template


def test_generation_config_eos_ids_become_stop_ids(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_pretrained_dir(tmp_path).stop_token_ids == {0, 2, 5, 7}


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
@pytest.mark.parametrize("add_bos", [True, False])
def test_other_pre_tokenizers_match_transformers(pre, add_bos, write_tiny_gguf):
    transformers = pytest.importorskip("transformers")
    path = write_tiny_gguf(pre=pre, add_bos=add_bos)
    ours = Tokenizer.from_gguf_reader(gguf.GGUFReader(path))
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.add_bos is add_bos
    for text in ["hello hello 1234567  12\n\n  x", "<s>hello</s> Hello's", "", *CORPUS[3:6]]:
        assert ours.encode(text) == theirs.encode(text), text
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == (
        theirs.apply_chat_template(messages, tokenize=False)
    )


def test_llama3_takes_vocabulary_words_whole_and_adds_bos_by_default(write_tiny_gguf):
    # llama.cpp and Llama 3's tokenizer.json (ignore_merges); transformers' GGUF loader does not.
    llama3 = Tokenizer.from_gguf_reader(gguf.GGUFReader(write_tiny_gguf(add_bos=None)))
    gpt2 = Tokenizer.from_gguf_reader(gguf.GGUFReader(write_tiny_gguf("default", add_bos=None)))
    world = llama3.backend.token_to_id("Ġworld")
    assert llama3.encode(" world hello") == [0, world, llama3.backend.token_to_id("Ġhello")]
    assert gpt2.encode(" world", add_special_tokens=False) == [
        gpt2.backend.token_to_id(byte_to_unicode()[b]) for b in b" world"
    ]
    assert (llama3.add_bos, gpt2.add_bos) == (True, False)


def test_unsupported_pre_tokenizer_names_file_and_value(write_tiny_gguf):
    path = write_tiny_gguf(pre="deepseek-llm")
    with pytest.raises(ValueError, match=r"tiny-deepseek-llm-gpt2\.gguf.*'deepseek-llm'"):
        Tokenizer.from_gguf_reader(gguf.GGUFReader(path))


def test_sentencepiece_gguf_is_refused_with_file_name(write_tiny_gguf):
    path = write_tiny_gguf(model="llama")
    with pytest.raises(ValueError, match=r"tiny-llama-bpe-llama\.gguf.*'llama'.*gpt2"):
        Tokenizer.from_gguf_reader(gguf.GGUFReader(path))


def test_missing_directory_and_files_are_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"nope: tokenizer directory does not exist"):
        Tokenizer.from_pretrained_dir(missing)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json: missing"):
        Tokenizer.from_pretrained_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        Tokenizer.from_pretrained_dir(tmp_path)


def test_bad_tokenizer_config_is_named(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: expected a JSON object"):
        Tokenizer.from_pretrained_dir(tmp_path)
    config.write_text(json.dumps({"eos_token": "<|not_a_token|>"}))
    with pytest.raises(ValueError, match=r"eos_token '<\|not_a_token\|>' is not in the vocab"):
        Tokenizer.from_pretrained_dir(tmp_path)


def test_encoding_a_long_text_in_a_worker_thread_leaves_the_event_loop_free(smollm2_tokenizer):
    """As the server tokenizes: asyncio.to_thread. (A bare `encode` held the GIL, which stalled
    the loop for the whole call, though a plain thread's sleep loop did not show it.)"""
    text = "word " * 400_000  # 2 MB: more than a second to encode

    async def worst_loop_gap() -> float:
        work = asyncio.ensure_future(asyncio.to_thread(smollm2_tokenizer.encode, text))
        worst, last = 0.0, time.monotonic()
        while not work.done():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        assert len(await work) == 400_001  # "word" 400,000 times, then the last space
        return worst

    gap = asyncio.run(worst_loop_gap())
    assert gap < 0.3, f"the event loop stalled for {gap:.2f} s"
