"""Tokenizer, chat template and incremental detokenizer for the scheduler (no torch, no
transformers).

Reads tokenizer.json with `tokenizers` and the chat template (tokenizer_config.json or
chat_template.jinja) with jinja2, the way transformers renders it.
"""

from __future__ import annotations

import codecs
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        # the tokenizers library's own
        self.hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        jinja_path = folder / "chat_template.jinja"
        if not template and jinja_path.exists():
            template = jinja_path.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": "..."}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template or None
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self._template = None
        self._max_token_bytes: int | None = None
        self._token_bytes: list[bytes] | None | bool = False  # False: not looked at yet
        self._token_bytes_special: list[bytes] | None | bool = False
        # The special tokens' texts a template may name (bos_token, eos_token, pad_token, unk_token,
        # ...).
        self._special_texts = {
            k: t for k, v in cfg.items() if k.endswith("_token") and (t := _token_text(v))
        }
        if self.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)

    def to_json(self) -> str:
        """The tokenizer.json text (structured output builds its own token trie from it)."""
        return self.hf.to_str()

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token, so a prompt can be refused as too long untokenized."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(
                (len(t.encode()) for t in self.hf.get_vocab(with_added_tokens=True)), default=1
            )
        return self._max_token_bytes

    @property
    def token_bytes(self) -> list[bytes] | None:
        """Each token's UTF-8 bytes for byte-level BPE (special: b""); None otherwise."""
        if self._token_bytes is False:
            self._token_bytes = self._byte_table()
        return self._token_bytes

    @property
    def token_bytes_with_special(self) -> list[bytes] | None:
        """token_bytes, but special tokens stand for their own text (skip_special_tokens=false)."""
        if self._token_bytes_special is False:
            self._token_bytes_special = self._byte_table(keep_special=True)
        return self._token_bytes_special

    def warm(self) -> None:
        """Build the byte tables while the workers load."""
        self.token_bytes  # noqa: B018 - the property builds and keeps the table
        self.token_bytes_with_special  # noqa: B018

    def _byte_table(self, keep_special: bool = False) -> list[bytes] | None:
        spec = json.loads(self.hf.to_str())
        if (spec.get("decoder") or {}).get("type") != "ByteLevel":
            return None
        to_byte = _gpt2_byte_decoder()
        table = [b""] * self.vocab_size
        for token, i in self.hf.get_vocab(with_added_tokens=False).items():
            try:
                table[i] = bytes(to_byte[c] for c in token)
            # a vocabulary entry outside the byte alphabet: not a plain byte-level BPE
            except KeyError:
                return None
        for added in spec.get("added_tokens", []):  # as the tokenizer itself decodes each one alone
            special = added.get("special") and not keep_special
            text = "" if special else self.hf.decode([added["id"]], skip_special_tokens=False)
            table[added["id"]] = text.encode()
        return table

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
    ) -> str:
        """Render a conversation as transformers does; continue_final_message leaves the last
        message open.
        """
        if self._template is None:
            raise ValueError(
                "this model has no chat template; send a raw prompt or prompt_token_ids"
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        context = {
            "bos_token": "",
            "eos_token": "",
            **self._special_texts,
            **(template_kwargs or {}),
        }
        try:
            text = self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template refused the conversation: {e}") from e
        except (
            TypeError,
            KeyError,
            AttributeError,
        ) as e:  # a template indexing a field the message lacks
            raise ValueError(
                f"the chat template failed on the conversation: {type(e).__name__}: {e}"
            ) from e
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final.strip():
                raise ValueError(
                    "continue_final_message needs a last message with text to continue"
                )
            end = text.rfind(final.strip())
            if end < 0:
                raise ValueError(
                    "continue_final_message: the template does not write the last message's text"
                )
            text = text[: end + len(final.strip())]
        return text

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """A conversation → token ids (the template writes the special tokens itself)."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    def encode_prompt(self, prompt: str, raw: bool) -> list[int]:
        """Text to ids, through the chat template unless raw."""
        if raw or self._template is None:
            return self.encode(prompt, add_special_tokens=True)
        text = self.apply_chat_template([{"role": "user", "content": prompt}])
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Text deltas without re-decoding: a byte table for byte-level BPE, else DecodeStream."""

    CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._table = (
            tokenizer.token_bytes if skip_special_tokens else tokenizer.token_bytes_with_special
        )
        if self._table is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            return
        self._hf = tokenizer.hf
        self._stream = DecodeStream(
            ids=list(prompt_ids[-self.CONTEXT_TOKENS :]), skip_special_tokens=skip_special_tokens
        )

    def add(self, token_id: int) -> str:
        if self._table is not None:
            if 0 <= token_id < len(self._table):
                return self._utf8.decode(self._table[token_id])
            return ""
        return self._stream.step(self._hf, token_id) or ""


def _gpt2_byte_decoder() -> dict[str, int]:
    """The byte-level alphabet: printable bytes stand for themselves, the other
    68 for chr(256 + k).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        return value.get("content")
    return value if isinstance(value, str) else None


def _tojson(
    value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False
) -> str:
    """transformers' tojson: keys kept in order and non-ASCII kept
    (jinja's own sorts and escapes).
    """
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class TokenTable:
    """A token's text and bytes as logprobs show them (a partial character shows U+FFFD)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def bytes(self, token: int) -> bytes:
        table = self.tokenizer.token_bytes_with_special  # built once, by the tokenizer
        if table is not None and token < len(table):
            return table[token]
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")
