"""The tokenizer the engine and server use: ids, text, special and stop tokens, chat template.

It wraps a `tokenizers.Tokenizer` (Rust, fast) built either from a GGUF's metadata or from an HF
directory (`tokenizer.json` + `tokenizer_config.json`), and can save itself as such a directory
so a converted-model cache reloads it without re-reading the GGUF.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer as BackendTokenizer

from jserve.loaders.chat_template import (
    ChatTemplateError,
    continued_final_message,
    render_chat_template,
)
from jserve.loaders.gguf_tokenizer import build_gguf_tokenizer, gguf_path

# Special tokens that end a turn in common chat formats. llama.cpp treats these as end of
# generation as well as the declared EOS; e.g. SmolLM2 ends a document with <|endoftext|> but a
# chat turn with <|im_end|>.
END_OF_TURN_TOKENS = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"}
)

# Our own key in tokenizer_config.json, for stop ids a GGUF declares (eot/eom) that the HF
# format has no place for, so a saved tokenizer reloads with the same stop set.
_EXTRA_STOPS_KEY = "jserve_extra_stop_token_ids"


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_stop_token_ids: Iterable[int] = (),
        chat_template: str | None,
        source: str,
    ) -> None:
        """Prefer `from_gguf_reader` / `from_pretrained_dir`. `source` names the files in errors."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.source = source
        self._extra_stop_token_ids = frozenset(extra_stop_token_ids)
        added = backend.get_added_tokens_decoder()
        self.added_tokens: dict[int, str] = {i: t.content for i, t in added.items()}
        specials = {i for i, t in added.items() if t.special}
        end_of_turn = {i for i in specials if backend.id_to_token(i) in END_OF_TURN_TOKENS}
        declared = {eos_token_id} if eos_token_id is not None else set()
        self.stop_token_ids: frozenset[int] = frozenset(
            declared | end_of_turn | self._extra_stop_token_ids
        )
        # Whether encode(add_special_tokens=True) prepends BOS is the backend's post-processor's
        # decision (tokenizer.json carries it); ask it rather than keeping a second copy.
        first = backend.encode("a", add_special_tokens=True).ids[:1]
        self.add_bos: bool = bos_token_id is not None and first == [bos_token_id]

    @classmethod
    def from_gguf_reader(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """The tokenizer in a GGUF's metadata (byte-level BPE only; see `gguf_tokenizer`)."""
        data = build_gguf_tokenizer(reader)
        return cls(
            data.backend,
            bos_token_id=data.bos_token_id,
            eos_token_id=data.eos_token_id,
            extra_stop_token_ids=data.extra_stop_token_ids,
            chat_template=data.chat_template,
            source=gguf_path(reader),
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """An HF-style tokenizer directory: `tokenizer.json`, and optionally
        `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`, `config.json`.

        EOS is `tokenizer_config.json`'s eos_token, else the first eos_token_id of
        generation_config.json / config.json; every eos_token_id listed there is a stop token.
        """
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: tokenizer directory does not exist")
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file}: missing; a tokenizer directory needs tokenizer.json (write one "
                "with transformers' save_pretrained or jserve's Tokenizer.save)"
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust side raises a bare Exception on bad JSON
            raise ValueError(f"{tokenizer_file}: not a valid tokenizer.json: {err}") from err
        config = _read_json(directory / "tokenizer_config.json")
        declared_eos = [
            *_id_list(_read_json(directory / "generation_config.json").get("eos_token_id")),
            *_id_list(_read_json(directory / "config.json").get("eos_token_id")),
        ]

        def special_id(name: str, fallback: int | None) -> int | None:
            token = _token_content(config.get(name))
            if token is None:
                return fallback
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ValueError(
                    f"{directory / 'tokenizer_config.json'}: {name} {token!r} is not in the "
                    "vocabulary of tokenizer.json"
                )
            return token_id

        return cls(
            backend,
            bos_token_id=special_id("bos_token", None),
            eos_token_id=special_id("eos_token", declared_eos[0] if declared_eos else None),
            extra_stop_token_ids=[*declared_eos, *config.get(_EXTRA_STOPS_KEY, [])],
            chat_template=_chat_template_from_dir(directory, config),
            source=str(directory),
        )

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json (loadable by `from_pretrained_dir` and by
        transformers' AutoTokenizer)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "chat_template": self.chat_template,
        }
        if self._extra_stop_token_ids:
            config[_EXTRA_STOPS_KEY] = sorted(self._extra_stop_token_ids)
        with open(directory / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text in it (e.g. "<|im_start|>") becomes that special
        token, as in transformers; `add_special_tokens` adds BOS/EOS as the model asks.

        Through `encode_batch`, which releases the GIL while it works: `encode` holds it for as
        long as it runs (long for megabytes of text), stalling the server's event loop even from
        a worker thread.
        """
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **variables: Any,
    ) -> str | list[int]:
        """The model's prompt for a conversation, as text or (tokenize=True) ids; with
        `chat_template` (transformers') that template instead of the model's.

        Tokenizing adds no BOS/EOS beyond what the template writes, as in transformers. With
        `continue_final_message` (transformers') the prompt ends inside the final message, which
        the model continues (chat_template.continued_final_message; no generation prompt).

        Raises:
            ChatTemplateError: the model has no chat template, or it rejects the conversation.
        """
        template = self.chat_template if chat_template is None else chat_template
        if template is None:
            raise ChatTemplateError(
                f"{self.source}: this model has no chat template, so chat requests cannot be "
                "formatted; send a plain completion prompt instead"
            )
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        text = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            tools=tools,
            **{**{k: v for k, v in specials.items() if v is not None}, **variables},
        )
        if continue_final_message:
            text = continued_final_message(text, messages)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_json(path: Path) -> dict[str, Any]:
    """The object in a JSON file, or {} if the file does not exist."""
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read as JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _token_content(value: str | Mapping[str, Any] | None) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken.
    return value.get("content") if isinstance(value, Mapping) else value


def _chat_template_from_dir(directory: Path, config: Mapping[str, Any]) -> str | None:
    # transformers >= 4.43 may save the template as its own file; it wins over the config entry.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:
            raise ValueError(
                f"{directory / 'tokenizer_config.json'}: chat_template lists {sorted(named)} "
                "but no 'default' template"
            )
        template = named["default"]
    return template
