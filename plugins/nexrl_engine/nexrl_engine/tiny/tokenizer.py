"""Build the tiny model's tokenizer offline: byte-level BPE plus a ChatML chat template.

No tokenizer can be downloaded here, so one is trained in a fraction of a second on
generated text. Choices and why:

* Byte-level BPE: every string round-trips, including JSON and tool output.
* Digits are split into single-digit tokens before BPE, so ``"137"`` is always
  ``1 3 7`` and column-wise addition is learnable by a 2 M parameter model.
* The pre-tokenizer (NFC, then a Qwen2-style split: contractions, words with an
  optional leading non-letter, single digits, punctuation runs, newlines, spaces) is
  exactly what transformers 5 installs when it loads any tokenizer saved next to a
  ``qwen2`` config: it treats ``tokenizer_class`` of qwen2 checkpoints as unreliable and
  rebuilds ``Qwen2Tokenizer`` from the vocabulary and merges. Training the merges under
  the same segmentation keeps the built and the reloaded tokenizer identical.
* ChatML markers as in Qwen2.5 (``<|im_start|>``, ``<|im_end|>`` = EOS,
  ``<|endoftext|>`` = pad), so renderers written for Qwen models work on it.
* ``<tool_call>`` / ``</tool_call>`` are single added tokens but not *special*: a
  response decoded with ``skip_special_tokens=True`` still shows them, which a tool-call
  parser needs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from nexrl_engine.tiny.addition import train_problems

__all__ = [
    "CHAT_TEMPLATE",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "VOCAB_SIZE",
    "build_tokenizer",
    "training_corpus",
]

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
VOCAB_SIZE = 1024
"""Total vocabulary, added tokens included."""
MODEL_MAX_LENGTH = 2048
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"  # English contractions
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"  # a word, with at most one leading non-letter (space, quote)
    r"|\p{N}"  # one digit at a time
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"  # a punctuation run, with its space and trailing newlines
    r"|\s*[\r\n]+"  # newlines with the spaces before them
    r"|\s+(?!\S)"  # spaces not followed by a word
    r"|\s+"
)
"""Pre-tokenizer split; must equal the one transformers uses for Qwen2 tokenizers (see above)."""

# A ChatML template in the style of Qwen2.5, written for this project. Tool schemas go
# into the system turn; an assistant tool call is rendered as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>; consecutive tool results are
# merged into one user turn of <tool_response> blocks.
CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set system_text = text_of(messages[0].content) -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set system_text = none -%}
{%- set turns = messages -%}
{%- endif -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if system_text -%}{{- system_text + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou can call the functions described below, one JSON schema per line inside <tools></tools>:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nTo call a function, answer with its name and arguments as JSON inside <tool_call></tool_call> tags:\n<tool_call>{"name": <function-name>, "arguments": <arguments-object>}</tool_call><|im_end|>\n' -}}
{%- elif system_text is not none -%}
{{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in turns -%}
{%- if message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + text_of(message.content) -}}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

_WORDS = (
    "the a an and or but if then else when while for with without of to in on at by from "
    "is are was were be been has have had do does did can could will would should may might "
    "i you he she it we they me him her us them my your his its our their this that these those "
    "what which who whom whose where why how all any both each few more most other some such "
    "no not only own same so than too very just now also here there again once "
    "user assistant system tool function call result answer question number numbers sum add plus "
    "minus times total value values name names argument arguments weather city today tomorrow "
    "temperature search query file files read write list lists open close time date day days "
    "hello thanks please sorry yes okay sure help find get set make use run test check compute "
    "calculate return error ok done first second third last next step steps think thought reason "
    "because therefore result results output input text string json object array true false null "
    "good bad big small new old long short high low right left up down begin end start stop "
    "model data train training reward learn learning policy sample samples token tokens batch "
    "python code line lines print value key keys type types message messages content role "
    "water fire earth air light dark red green blue black white cat dog bird fish tree house "
    "car road book word words world people person man woman child children friend family"
).split()

_TOOLS = (
    ("get_weather", {"city": ["Paris", "Tokyo", "Lima", "Oslo", "Cairo"], "unit": ["celsius", "fahrenheit"]}),
    ("calculator", {"expression": ["12+7", "3*4", "100-58", "9/3", "2**10"]}),
    ("search", {"query": ["tiny models", "reinforcement learning", "addition table", "weather today"]}),
    ("read_file", {"path": ["notes.txt", "data.json", "main.py", "README.md"]}),
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    return text + rng.choice([".", ".", ".", "?", "!", ":", ","])


def _tool_schema(name: str, params: dict[str, list[str]]) -> dict[str, object]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name.replace('_', ' ')} tool.",
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string"} for key in params},
                "required": list(params),
            },
        },
    }


def training_corpus(seed: int = 0, lines: int = 3000) -> Iterator[str]:
    """Generated lines that look like what the model will see: ChatML turns, arithmetic,
    English-like sentences, tool schemas and tool calls as JSON."""
    rng = random.Random(seed)
    problems = train_problems()
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            problem = problems[rng.randrange(len(problems))]
            yield (f"{IM_START}user\n{problem.prompt}{IM_END}\n{IM_START}assistant\n{problem.answer}{IM_END}\n")
        elif kind == 1:
            yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
        elif kind == 2:
            name, params = _TOOLS[rng.randrange(len(_TOOLS))]
            arguments = {key: rng.choice(values) for key, values in params.items()}
            call = json.dumps({"name": name, "arguments": arguments})
            yield (
                f"{IM_START}assistant\n{TOOL_CALL_START}{call}{TOOL_CALL_END}{IM_END}\n"
                f"{IM_START}user\n<tool_response>\n{json.dumps({'result': _sentence(rng)})}\n</tool_response>{IM_END}\n"
            )
        else:
            name, params = _TOOLS[rng.randrange(len(_TOOLS))]
            yield json.dumps(_tool_schema(name, params))


def build_tokenizer(out_dir: str | Path | None = None, *, seed: int = 0) -> object:
    """Train the tokenizer, wrap it as a transformers fast tokenizer and optionally save it.

    Returns the transformers tokenizer. Deterministic: the same seed gives the same
    ``tokenizer.json`` byte for byte.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = [ENDOFTEXT, IM_START, IM_END]
    plain_added = [TOOL_CALL_START, TOOL_CALL_END]
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(plain_added),
        min_frequency=2,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(seed), trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in plain_added])
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        padding_side="left",
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    if out_dir is not None:
        wrapped.save_pretrained(str(out_dir))
    return wrapped
