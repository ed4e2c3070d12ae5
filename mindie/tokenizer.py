"""Tokenizer and chat template, from a Hugging Face directory or a GGUF file's metadata.

Encoding and decoding use Hugging Face `tokenizers`; chat templates render in Jinja2's
ImmutableSandboxedEnvironment, never a plain one, since a template is code that came with a model.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# Pre-tokenizer patterns of the GGUF `tokenizer.ggml.pre` names we support (as in llama.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF token types (llama.cpp's llama_token_type) and what llama.cpp does with each when it turns
# a token into text: NORMAL tokens are decoded (byte-level), USER_DEFINED ones written as they are,
# CONTROL and UNKNOWN ones written only when special tokens are asked for, and UNUSED (the
# converter's `[PAD<id>]` padding up to the model's vocabulary) and UNDEFINED ones never; neither
# of those two is ever read from text either. BYTE tokens of a byte-level vocabulary decode as NORMAL.
_GGUF_UNDEFINED, _GGUF_NORMAL, _GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED, _GGUF_UNUSED, _GGUF_BYTE = range(7)
_GGUF_SPECIAL = (_GGUF_CONTROL, _GGUF_UNKNOWN)
_GGUF_NEVER_TEXT = (_GGUF_UNUSED, _GGUF_UNDEFINED)


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in ("gpt2", "gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}.get(pre)
    if split is None:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (smollm, gpt2, qwen2, llama-bpe)")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool,
        chat_template: str | None,
        pad_token_id: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """`vocab_size`: the ids the vocabulary spans where some have no token in `backend` (a
        GGUF's UNUSED ones); None: the backend's size."""
        self.backend = backend
        self._vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self.special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.special_texts = tuple(t for t in (backend.id_to_token(i) for i in self.special_ids) if t)

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        backend = BackendTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        template_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(template_file):
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        template_json = os.path.join(path, "chat_template.json")  # where Qwen2-VL's processors keep it
        if template is None and os.path.exists(template_json):
            with open(template_json, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        bos = _token_content(cfg.get("bos_token"))
        eos = _token_content(cfg.get("eos_token"))
        pad = _token_content(cfg.get("pad_token"))
        eos_ids = list(eos_token_ids)
        if eos is not None and backend.token_to_id(eos) is not None and backend.token_to_id(eos) not in eos_ids:
            eos_ids.append(backend.token_to_id(eos))
        return cls(
            backend,
            backend.token_to_id(bos) if bos is not None else None,
            eos_ids,
            bool(cfg.get("add_bos_token", False)),
            template if isinstance(template, str) else None,
            backend.token_to_id(pad) if pad is not None else None,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported yet (only byte-level BPE, 'gpt2'); "
                "use the model's Hugging Face directory with tokenizer.json instead"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_GGUF_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ValueError(f"GGUF tokenizer: {len(types)} token types for {len(tokens)} tokens")
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        # Tokens that are never text are left out: their ids decode to nothing (as a Hugging Face
        # tokenizer decodes ids past its vocabulary, where those checkpoints pad) and no text
        # encodes to them. The rest keep their ids.
        vocab = {tok: i for i, (tok, k) in enumerate(zip(tokens, types)) if k not in _GGUF_NEVER_TEXT}
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _GGUF_USER_DEFINED]
        )
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in _GGUF_SPECIAL]
        )
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        pad = meta.get("tokenizer.ggml.padding_token_id")
        return cls(
            backend,
            None if bos is None else int(bos),
            () if eos is None else (int(eos),),
            bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            meta.get("tokenizer.chat_template"),
            None if pad is None else int(pad),
            vocab_size=len(tokens),
        )

    # --- text <-> ids ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size or self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    @functools.cached_property
    def _plain(self) -> BackendTokenizer:
        """The same vocabulary with special-token text read as plain text: for what clients wrote
        inside a chat message, so "<|im_start|>" there is never a control token. Built at first
        use (a second copy of the vocabulary, tens of MB, that most servers never need)."""
        plain = BackendTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of untrusted text: special-token strings in it stay text."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # --- chat ------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        template: str | None = None,
        **extra: Any,
    ) -> str:
        """Renders the model's chat template, or `template` (a client's own) in its place."""
        source = template if template is not None else self.chat_template
        if source is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return _compile_template(source).render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            **extra,
        )


@functools.lru_cache(maxsize=16)  # the model's template, and a few that clients send
def _compile_template(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
