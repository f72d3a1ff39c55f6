"""Tokenizer, chat template and incremental detokenizer for the scheduler (no torch, no transformers).

Reads tokenizer.json with `tokenizers` and the chat template (tokenizer_config.json or
chat_template.jinja) with jinja2, the way transformers renders it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
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
        if self.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """Bytes of UTF-8 the longest token can stand for (an upper bound): a text of B bytes has at least
        B / max_token_bytes tokens, so a prompt can be refused as too long without tokenizing it."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max((len(t.encode()) for t in self._tok.get_vocab(with_added_tokens=True)),
                                        default=1)
        return self._max_token_bytes

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; send a raw prompt")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_prompt(self, prompt: str, raw: bool) -> list[int]:
        """A user's text prompt → token ids: through the chat template unless raw (or no template)."""
        if raw or self._template is None:
            return self.encode(prompt, add_special_tokens=True)
        text = self.apply_chat_template([{"role": "user", "content": prompt}])
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    tokenizers' DecodeStream (Rust) keeps the window itself: primed with the last few prompt tokens (for
    spacing context), each step returns the new text, or nothing while a multi-byte character is still
    being built (byte-fallback tokens)."""

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self._hf = tokenizer._tok
        self._stream = DecodeStream(ids=list(prompt_ids[-self.CONTEXT_TOKENS :]), skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        return self._stream.step(self._hf, token_id) or ""


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)
