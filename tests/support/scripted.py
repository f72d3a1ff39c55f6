"""An engine that answers every request with a recorded token stream, detokenized as the engine
does (special tokens kept or skipped as the request asks): the API surface's parsing tested on
answers a real model writes, without one. And a tiny tokenizer and template that speak harmony.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from scheduler_service.core.sequence import FinishReason
from scheduler_service.text.limits import Limits
from scheduler_service.text.output import Delta, Usage
from scheduler_service.text.structured import GrammarEngine
from scheduler_service.text.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.support.tiny import CORPUS

HARMONY_SPECIALS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]

# gpt-oss's template in small: the effort in the system message, tools in a developer message,
# an assistant's calls and the tools' answers in commentary, the turn opened at `<|start|>assistant`
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools"
    "{% for t in tools %}\n{{ t.function.name }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|start|>functions.{{ m.name or 'tool' }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>"
    "{{ c.function.arguments }}<|call|>{% endfor %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def make_harmony_tokenizer(folder: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE with harmony's markers as special tokens, and the template above."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = HF(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=HARMONY_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "chat_template": HARMONY_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


class ScriptedEngine:
    """What the API routes use of an Engine; every request is answered with `script` (token ids),
    a token a delta, the last one ending it. `requests` keeps what each call was asked.
    """

    def __init__(self, folder: Path, name: str = "scripted") -> None:
        self.tokenizer = Tokenizer(folder)
        vocab = self.tokenizer.hf.get_vocab_size()
        self.spec = SimpleNamespace(
            name=name, sampling_defaults={}, pooling=None, generates=True, max_context=4096
        )
        end = (self.tokenizer.hf.token_to_id("<|return|>"),)
        grammars = GrammarEngine(self.tokenizer.to_json(), vocab, end)
        self.limits = Limits(vocab, 4096, 1024, 16, eos_token_ids=end, grammars=grammars)
        self.adapters = None
        self.script: list[int] = []
        self.requests: list = []

    def say(self, text: str) -> None:
        """The next answers: text as the model writes it (markers are its special tokens)."""
        self.script = self.tokenizer.hf.encode(text, add_special_tokens=False).ids

    async def generate(self, request):
        self.requests.append(request)
        detok = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling.skip_special_tokens
        )
        for i, token in enumerate(self.script):
            last = i == len(self.script) - 1
            yield Delta(
                0,
                [token],
                detok.add(token),
                FinishReason.STOP if last else None,
                Usage(request.prompt_len, len(self.script), 0) if last else None,
            )
