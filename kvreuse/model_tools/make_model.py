"""Make complete Hugging Face model folders with random weights and a real trained tokenizer.

Weights can never be downloaded here, so tests, demos and benchmarks run on folders made by this
module: config.json with the real shapes of a named model, seeded random weights in safetensors
(HF parameter names), and a byte-level BPE tokenizer trained deterministically on the corpus that
ships in ``kvreuse/data/corpus.txt``, with a ChatML chat template that takes tools (Qwen2.5's shape and
tool-call tokens, so tests and demos run real tool loops); gpt-oss presets get the harmony format instead (its
special tokens added to the trained tokenizer, a harmony chat template, ``<|return|>`` / ``<|call|>`` as stop
tokens). The folders load offline in ``transformers``
as well as in our own loader, so the two can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvreuse.config import cache_dir, parse_memory_size
from kvreuse.models.config import ModelConfig

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BpeTokenizer

# Bump when anything that changes the produced folders changes (names, shapes, init, tokenizer
# recipe), so cached folders and tokenizers made by an older version are not reused.
RECIPE_VERSION = 2

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # trained first, so their ids are 0, 1, 2
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
# Added after training as the last ids, as Qwen2.5 / Qwen3 add them: one token each, but not special, so
# decoding keeps them in the text (the tool-call parser reads them there) and a grammar can name them as text.
TOOL_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
# 256 byte tokens, the special tokens and the tool tokens; anything smaller cannot encode arbitrary text.
MIN_TOKENIZER_VOCAB = 256 + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
# gpt-oss's harmony format: special tokens added after training as the last ids (in the order of their ids in
# gpt-oss's o200k_harmony vocabulary). <|return|> ends a final answer and <|call|> a tool call: both stop
# generation; <|end|> ends a message the model continues after (its analysis), so it does not.
HARMONY_RETURN, HARMONY_CALL = "<|return|>", "<|call|>"
HARMONY_TOKENS = (HARMONY_RETURN, "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", HARMONY_CALL)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}
# Which architectures a preset's shapes can be written as: the dense family's presets swap freely; a preset
# with experts or Gemma's windows is written as its own architecture only.
DENSE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAFETENSORS_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

# Qwen2's pre-tokenizer split: contractions, words with one leading non-letter, single digits,
# punctuation runs, newlines and spaces.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

INIT_STD = 0.02
# Presets with fewer parameters get weights written by default; bigger ones get config + tokenizer
# only (the engine runs them with load_format="dummy").
DEFAULT_WRITE_WEIGHTS_MAX_PARAMS = 1_500_000_000
# Without an explicit max_shard_size, weights bigger than this are split like HF checkpoints.
AUTO_SHARD_BYTES = 2 * 1024**3
# Random numbers are generated in pieces of at most this many elements so memory stays bounded
# even for a 128256 x 4096 embedding.
GENERATION_CHUNK_ELEMENTS = 1 << 22

# ChatML, with tools in Qwen2.5-Instruct's shape (our own wording): with ``tools`` the system turn lists one
# JSON object per tool inside <tools></tools> and says how to call one; an assistant turn's calls follow its
# text as ``\n<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``; tool results go back inside a
# user turn as ``\n<tool_response>\n...\n</tool_response>`` (consecutive results share one turn). Arguments
# given as an object are written with ``tojson`` (json.dumps, ensure_ascii=False, ", " and ": "), which is
# the serialisation the hermes grammar makes the model generate, so a replayed call renders the tokens the
# model produced. A chat without tools, tool calls or tool results renders exactly as plain ChatML.
CHATML_TEMPLATE = (
    "{%- macro text_of(content) %}"
    "{%- if content is string %}"
    "{{- content }}"
    "{%- elif content is not none %}"
    "{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') }}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- text_of(messages[0]['content']) + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou can call functions to help with the request. Each function is described by one JSON '"
    " 'object per line inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with its name and a JSON object of arguments inside '"
    " '<tool_call></tool_call> tags, one pair of tags per call:\\n<tool_call>\\n'"
    " '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = text_of(message['content']) %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if content %}"
    "{{- '\\n' + content }}"
    "{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}"
    "{%- set tool_call = tool_call['function'] %}"
    "{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}"
    "{{- tool_call['arguments'] }}"
    "{%- else %}"
    "{{- tool_call['arguments'] | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


# Qwen3's thinking, on the ChatML template above: an assistant message in the history loses everything up to and
# including its last ``</think>`` and the newlines after it, as Qwen3's template renders it
# (``content.split('</think>')[-1].lstrip('\n')``), so a reasoning turn's thinking is dropped from the next turn's
# prompt. Qwen3 keeps the thinking of the assistant messages after the last user message (a tool loop within one
# turn); so does this one. The generation prompt is plain ``<|im_start|>assistant\n``: the model writes its own
# ``<think>``. ``<think>`` and ``</think>`` are plain text to the trained tokenizer (a few tokens each). Any other
# message renders exactly as CHATML_TEMPLATE renders it.
_CHATML_CONTENT = "{%- set content = text_of(message['content']) %}"
_CHATML_LOOP = "{%- for message in messages %}"
QWEN3_THINKING_TEMPLATE = CHATML_TEMPLATE.replace(
    _CHATML_LOOP,
    "{%- set think = namespace(last_query=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- set think.last_query = loop.index0 %}"
    "{%- endif %}"
    "{%- endfor %}"
    + _CHATML_LOOP,
).replace(
    _CHATML_CONTENT,
    _CHATML_CONTENT
    + "{%- if message['role'] == 'assistant' and loop.index0 < think.last_query and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}",
)
assert CHATML_TEMPLATE.count(_CHATML_LOOP) == 1 and CHATML_TEMPLATE.count(_CHATML_CONTENT) == 1, (
    "CHATML_TEMPLATE changed: update QWEN3_THINKING_TEMPLATE")


# gpt-oss's harmony format, simplified but faithful to its chat template: a system message naming the channels
# (and, with tools, that function calls go to the commentary channel); a system or developer message's text as the
# developer message's "# Instructions", the tools after it as a `functions` namespace (each tool's JSON schema
# in place of the TypeScript rendering); an assistant's answer on the final channel (earlier turns' analysis is
# dropped, as gpt-oss's template drops it); its tool calls as commentary messages to=functions.NAME with JSON
# arguments ended by <|call|>; a tool's result as a message from functions.NAME (the name of the call it
# answers) to the assistant. The generation prompt is ``<|start|>assistant``: the model writes the channel.
HARMONY_TEMPLATE = (
    "{%- macro text_of(content) %}"
    "{%- if content is string %}"
    "{{- content }}"
    "{%- elif content is not none %}"
    "{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') }}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{{- '<|start|>system<|message|>Reasoning: medium\\n\\n# Valid channels: analysis, commentary, final. '"
    " 'Channel must be included for every message.' }}"
    "{%- if tools %}"
    "{{- '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}"
    "{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- set first = messages[0] if messages else none %}"
    "{%- set has_instructions = first is not none and first['role'] in ('system', 'developer') %}"
    "{%- if has_instructions or tools %}"
    "{{- '<|start|>developer<|message|>' }}"
    "{%- if has_instructions %}"
    "{{- '# Instructions\\n\\n' + text_of(first['content']) }}"
    "{%- endif %}"
    "{%- if tools %}"
    "{%- if has_instructions %}{{- '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for tool in tools %}"
    "{%- set tool = tool['function'] if tool['function'] is defined else tool %}"
    "{%- if tool['description'] %}{{- '// ' + tool['description'] + '\\n' }}{%- endif %}"
    "{{- 'type ' + tool['name'] + ' = (_: ' + (tool['parameters'] | tojson) + ') => any;\\n\\n' }}"
    "{%- endfor %}"
    "{{- '} // namespace functions' }}"
    "{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- endif %}"
    "{%- set ns = namespace(call_name='') %}"
    "{%- for message in messages %}"
    "{%- set content = text_of(message['content']) %}"
    "{%- if loop.first and has_instructions %}"
    "{%- elif message['role'] in ('system', 'developer') %}"
    "{{- '<|start|>developer<|message|>' + content + '<|end|>' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}"
    "{%- set tool_call = tool_call['function'] %}"
    "{%- endif %}"
    "{%- set ns.call_name = tool_call['name'] %}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + tool_call['name'] + ' <|constrain|>json<|message|>' }}"
    "{%- if tool_call['arguments'] is string %}"
    "{{- tool_call['arguments'] }}"
    "{%- else %}"
    "{{- tool_call['arguments'] | tojson }}"
    "{%- endif %}"
    "{{- '<|call|>' }}"
    "{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + content + '<|end|>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- set name = message['name'] if message['name'] is defined and message['name'] else ns.call_name %}"
    "{{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary<|message|>' + content + '<|end|>' }}"
    "{%- else %}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + content + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start|>assistant' }}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class ModelPreset:
    """Shapes of a named model. ``vocab_size=None`` means the size of the trained tokenizer."""

    name: str
    arch: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int | None
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    tokenizer_vocab_size: int  # target size when training the tokenizer (the corpus may give fewer)
    qwen3_head_dim: int | None = None  # explicit head_dim when the arch is qwen3; None: hidden / heads
    llama3_original_max_position: int | None = None  # llama3 rope_scaling when the arch is llama
    # qwen3_moe: experts, routed per token, of moe_intermediate_size (intermediate_size: the dense layers')
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    # gemma3: every sliding_window_pattern-th layer global, the others over sliding_window tokens
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    query_pre_attn_scalar: int | None = None
    # gpt_oss: YaRN over the original context (factor 32 in gpt-oss); windows alternate with global layers
    yarn_original_max_position: int | None = None
    # Qwen3's thinking: the chat template drops earlier turns' <think>...</think> (QWEN3_THINKING_TEMPLATE)
    thinking_template: bool = False
    # lfm2: which layers attend (the others are short convolutions of conv_kernel taps); intermediate_size is
    # config.json's, which LFM2 adjusts (2/3 of it, rounded up to 256: 6656 gives 4608)
    attention_layers: tuple[int, ...] = ()
    conv_kernel: int = 3
    # qwen3_5: the Gated DeltaNet heads (key heads, value heads, key dim, value dim) and the rotary share of a head
    delta_heads: tuple[int, int, int, int] = (0, 0, 0, 0)
    partial_rotary_factor: float = 1.0
    # qwen3_5_moe: the shared expert's width (every layer's MLP is its experts; intermediate_size is unused)
    shared_expert_intermediate_size: int | None = None
    # nemotron_h: the layers' kinds as its config.json's hybrid_override_pattern writes them (M Mamba-2, * attention,
    # - MLP), and the Mamba-2 layers' heads, head width, B/C groups and state size
    hybrid_pattern: str = ""
    mamba_shape: tuple[int, int, int, int] = (0, 0, 0, 0)


PRESETS: dict[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        ModelPreset(
            name="tiny", arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False,
            rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-5,
            tokenizer_vocab_size=1024, qwen3_head_dim=32, llama3_original_max_position=256,
        ),
        ModelPreset(
            name="smollm2-135m", arch="llama", hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
            tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
            rms_norm_eps=1e-5, tokenizer_vocab_size=4096,
        ),
        ModelPreset(
            name="qwen2.5-0.5b", arch="qwen2", hidden_size=896, intermediate_size=4864,
            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
            tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768,
            rms_norm_eps=1e-6, tokenizer_vocab_size=4096,
        ),
        # Qwen3-30B-A3B's proportions (128 experts of 768 over hidden 2048, 8 per token, 48 layers) scaled to
        # 1.16B parameters, 0.14B of them active per token in the layers (0.30B with the output projection).
        ModelPreset(
            name="qwen3-moe-1b", arch="qwen3_moe", hidden_size=1024, intermediate_size=3072,
            num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, vocab_size=151936,
            tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=32768,
            rms_norm_eps=1e-6, tokenizer_vocab_size=4096, qwen3_head_dim=64,
            num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
        ),
        ModelPreset(
            name="tiny-moe", arch="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False,
            rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-6, tokenizer_vocab_size=1024,
            qwen3_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        ),
        # Gemma 3 1B's shapes (a 512-token window on five layers of six, one KV head of 256), with the trained
        # tokenizer's vocabulary instead of 262k rows.
        ModelPreset(
            name="gemma3-1b", arch="gemma3", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
            num_attention_heads=4, num_key_value_heads=1, vocab_size=None, tie_word_embeddings=True,
            rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6, tokenizer_vocab_size=4096,
            qwen3_head_dim=256, sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
        ),
        ModelPreset(
            name="tiny-gemma3", arch="gemma3", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=True,
            rope_theta=1000000.0, max_position_embeddings=2048, rms_norm_eps=1e-6, tokenizer_vocab_size=1024,
            qwen3_head_dim=32, sliding_window=16, sliding_window_pattern=6, query_pre_attn_scalar=32,
        ),
        # gpt-oss-20b's proportions (24 layers, 32 experts of intermediate = hidden, 4 per token, 64 query heads
        # to 8 KV heads of 64, a 128-token window on every other layer, sinks, YaRN x32 over 4,096) scaled to
        # 0.97B parameters, 0.17B of them active per token in the layers, with the trained tokenizer's vocabulary.
        ModelPreset(
            name="gpt-oss-1b", arch="gpt_oss", hidden_size=1024, intermediate_size=384, num_hidden_layers=24,
            num_attention_heads=16, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False,
            rope_theta=150000.0, max_position_embeddings=131072, rms_norm_eps=1e-5, tokenizer_vocab_size=4096,
            qwen3_head_dim=64, num_experts=32, num_experts_per_tok=4, sliding_window=128,
            yarn_original_max_position=4096,
        ),
        ModelPreset(
            name="tiny-gpt-oss", arch="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False,
            rope_theta=150000.0, max_position_embeddings=2048, rms_norm_eps=1e-5, tokenizer_vocab_size=1024,
            qwen3_head_dim=32, num_experts=8, num_experts_per_tok=4, sliding_window=16,
            yarn_original_max_position=64,
        ),
        # Qwen3 with its thinking template (issue 39's reasoning turns): tiny shapes with 4 layers (so chunk reuse's
        # default check layer 1 has layers after it), and SmolLM2-135M's shapes written as qwen3.
        ModelPreset(
            name="tiny-qwen3-think", arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False,
            rope_theta=1000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6, tokenizer_vocab_size=1024,
            qwen3_head_dim=32, thinking_template=True,
        ),
        ModelPreset(
            name="qwen3-think-135m", arch="qwen3", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, vocab_size=None, tie_word_embeddings=True,
            rope_theta=1000000.0, max_position_embeddings=8192, rms_norm_eps=1e-6, tokenizer_vocab_size=4096,
            qwen3_head_dim=64, thinking_template=True,
        ),
        # LFM2-350M's shapes (16 layers, attention at 2, 5, 8, 10, 12 and 14, the rest gated short convolutions),
        # with the trained tokenizer's vocabulary instead of 65,536 rows; and a tiny one with two conv layers
        # before its first attention layer.
        ModelPreset(
            name="lfm2-350m", arch="lfm2", hidden_size=1024, intermediate_size=6656, num_hidden_layers=16,
            num_attention_heads=16, num_key_value_heads=8, vocab_size=None, tie_word_embeddings=True,
            rope_theta=1000000.0, max_position_embeddings=128000, rms_norm_eps=1e-5, tokenizer_vocab_size=4096,
            attention_layers=(2, 5, 8, 10, 12, 14),
        ),
        ModelPreset(
            name="tiny-lfm2", arch="lfm2", hidden_size=64, intermediate_size=192, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=True,
            rope_theta=1000000.0, max_position_embeddings=2048, rms_norm_eps=1e-5, tokenizer_vocab_size=1024,
            attention_layers=(2,),
        ),
        # Qwen3.5-0.8B's shapes (24 layers, gated attention at every fourth with 8 query heads of 256 to 2 KV heads
        # and a quarter of each head turned, Gated DeltaNet elsewhere with 16 key and 16 value heads of 128), with the
        # trained tokenizer's vocabulary instead of 248,320 rows; and a tiny one with its attention layer last.
        ModelPreset(
            name="qwen3.5-0.8b", arch="qwen3_5", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
            num_attention_heads=8, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=True,
            rope_theta=10000000.0, max_position_embeddings=262144, rms_norm_eps=1e-6, tokenizer_vocab_size=4096,
            qwen3_head_dim=256, attention_layers=tuple(range(3, 24, 4)), conv_kernel=4,
            delta_heads=(16, 16, 128, 128), partial_rotary_factor=0.25,
        ),
        ModelPreset(
            name="tiny-qwen3.5", arch="qwen3_5", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=True,
            rope_theta=10000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6, tokenizer_vocab_size=1024,
            qwen3_head_dim=32, attention_layers=(3,), conv_kernel=4, delta_heads=(2, 4, 16, 16),
            partial_rotary_factor=0.25,
        ),
        # Qwen3.5-MoE (Qwen3.5-35B-A3B's layout: every layer's MLP 256 experts of 512, 8 a token, and a shared
        # expert of 512) at a tiny size: 8 experts of 32, 2 a token, a shared expert of 64.
        # ... and at qwen3-moe-1b's scale (16 layers of 64 experts of 256 over hidden 1,024, 8 a token), with
        # Qwen3.5-0.8B's attention and Gated DeltaNet heads (16 key and 16 value heads: llama.cpp's files keep equal
        # counts in HF's order) and a shared expert of 256: 0.98B parameters at the trained tokenizer's vocabulary.
        ModelPreset(
            name="qwen3.5-moe-1b", arch="qwen3_5_moe", hidden_size=1024, intermediate_size=3584, num_hidden_layers=16,
            num_attention_heads=8, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False,
            rope_theta=10000000.0, max_position_embeddings=262144, rms_norm_eps=1e-6, tokenizer_vocab_size=4096,
            qwen3_head_dim=256, attention_layers=tuple(range(3, 16, 4)), conv_kernel=4,
            delta_heads=(16, 16, 128, 128), partial_rotary_factor=0.25, num_experts=64, num_experts_per_tok=8,
            moe_intermediate_size=256, shared_expert_intermediate_size=256,
        ),
        ModelPreset(
            name="tiny-qwen3.5-moe", arch="qwen3_5_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False,
            rope_theta=10000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6, tokenizer_vocab_size=1024,
            qwen3_head_dim=32, attention_layers=(3,), conv_kernel=4, delta_heads=(2, 4, 16, 16),
            partial_rotary_factor=0.25, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        # Nemotron-H at half a billion parameters: Nemotron-H-8B's pattern (a Mamba-2 layer before each MLP block, an
        # attention block in every fourth pair) over 26 layers, its Mamba-2 proportions (heads of 64 with an inner
        # width of twice the hidden, 8 groups, a state of 128, a 4-tap convolution) and 128-wide attention heads
        # (12 to 4 KV heads); 0.46B parameters at 2,400 rows (the trained tokenizer's 2,388 rounded up to a multiple
        # of 8, as llama.cpp's converter pads Nemotron-H's vocabulary: its file would not load otherwise). And a tiny
        # one whose Mamba-2 layers sit before and after its attention block.
        ModelPreset(
            name="nemotron-h-0.5b", arch="nemotron_h", hidden_size=1536, intermediate_size=6144, num_hidden_layers=26,
            num_attention_heads=12, num_key_value_heads=4, vocab_size=2400, tie_word_embeddings=False,
            rope_theta=10000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, tokenizer_vocab_size=4096,
            qwen3_head_dim=128, conv_kernel=4, hybrid_pattern="M-M-M-M*-M-M-M-M*-M-M-M-M-",
            mamba_shape=(48, 64, 8, 128),
        ),
        ModelPreset(
            name="tiny-nemotron-h", arch="nemotron_h", hidden_size=64, intermediate_size=96, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False,
            rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-5, tokenizer_vocab_size=1024,
            qwen3_head_dim=16, conv_kernel=4, hybrid_pattern="M-*M-", mamba_shape=(8, 16, 2, 16),
        ),
        ModelPreset(
            name="llama-3-8b", arch="llama", hidden_size=4096, intermediate_size=14336,
            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
            tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=8192,
            rms_norm_eps=1e-5, tokenizer_vocab_size=4096,
        ),
    )
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One weight to generate: its HF name, shape and how to initialise it."""

    name: str
    shape: tuple[int, ...]
    # "normal" (std INIT_STD), "ones" (norm weights), "zeros" (Gemma's norms: they scale by 1 + w) or "log_range"
    # (log(1), log(2), ...: a Mamba-2 layer's A_log, one decay per head as transformers initialises it)
    init: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# ----------------------------------------------------------------------------------------------
# Cache locations


def default_model_dir(preset: str, arch: str | None = None, dtype: str = "bfloat16") -> Path:
    """Where :func:`ensure_model` keeps the folder for ``preset`` (under the cache dir)."""
    _check_choice("preset", preset, PRESETS)
    if arch is not None:
        _check_choice("arch", arch, ARCHITECTURES)
    _check_choice("dtype", dtype, DTYPES)
    arch_part = f"-{arch}" if arch is not None else ""
    return cache_dir() / "models" / f"{preset}{arch_part}-{dtype}-r{RECIPE_VERSION}"


def ensure_model(preset: str, arch: str | None = None, dtype: str = "bfloat16") -> Path:
    """Return the cached folder for ``preset``, making it first if needed.

    The folder is built in a temporary directory beside the final one and renamed into place, so a
    crash or a concurrent maker never leaves a half-written folder at the final path.
    """
    final_dir = default_model_dir(preset, arch, dtype)
    if (final_dir / "config.json").is_file():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    try:
        make_model(staging_dir, preset=preset, arch=arch, dtype=dtype)
        try:
            os.rename(staging_dir, final_dir)
        except OSError:
            # Someone else finished first; theirs is identical (same recipe, same seed).
            if not (final_dir / "config.json").is_file():
                raise
    finally:
        if staging_dir.exists():
            shutil.rmtree(staging_dir, ignore_errors=True)
    return final_dir


# ----------------------------------------------------------------------------------------------
# Tokenizer


def _corpus_bytes() -> bytes:
    return CORPUS_PATH.read_bytes()


def _tokenizer_cache_key(corpus: bytes, vocab_size: int) -> str:
    digest = hashlib.sha256()
    digest.update(f"kvreuse-bpe-r{RECIPE_VERSION}-v{vocab_size}\n".encode())
    digest.update(corpus)
    return f"{digest.hexdigest()[:20]}-v{vocab_size}"


def _train_tokenizer(corpus: bytes, vocab_size: int) -> BpeTokenizer:
    """Byte-level BPE with Qwen2's pipeline. Training is deterministic for a given corpus and size.

    The tool tokens are added after training as the last ``len(TOOL_TOKENS)`` ids (so ``vocab_size`` is
    still the total), unnormalised and not special, as Qwen's tokenizers have them.

    The pipeline (NFC, Qwen2's split regex, byte level without its own regex) is exactly what
    transformers' Qwen2Tokenizer rebuilds from vocab + merges for model_type "qwen2", so every arch
    tokenizes the same text to the same ids in transformers and in tokenizer.json alike.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Blank-line separated documents, so merges never span two unrelated pieces of text.
    documents = corpus.decode("utf-8").split("\n\n")
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    return tokenizer


def trained_tokenizer_path(vocab_size: int) -> Path:
    """Path of ``tokenizer.json`` trained to ``vocab_size`` on the embedded corpus (cached)."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_TOKENIZER_VOCAB:
        raise ValueError(f"tokenizer vocab_size must be an int >= {MIN_TOKENIZER_VOCAB}, got {vocab_size!r}")
    corpus = _corpus_bytes()
    path = cache_dir() / "tokenizers" / _tokenizer_cache_key(corpus, vocab_size) / "tokenizer.json"
    if path.is_file():
        return path
    tokenizer = _train_tokenizer(corpus, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(path, tokenizer.to_str(pretty=True))
    return path


# ----------------------------------------------------------------------------------------------
# Config and weight layout


@dataclass(frozen=True)
class ResolvedModel:
    """Everything needed to write one folder: preset + arch + vocab sizes decided."""

    preset: ModelPreset
    arch: str
    vocab_size: int
    head_dim: int
    dtype: str


def _resolve(preset_name: str, arch: str | None, dtype: str, tokenizer_vocab: int,
             vocab_size_override: int | None) -> ResolvedModel:
    preset = PRESETS[preset_name]
    final_arch = arch or preset.arch
    if final_arch != preset.arch and not (final_arch in DENSE_ARCHITECTURES and preset.arch in DENSE_ARCHITECTURES):
        raise ValueError(f"preset {preset_name!r} ({preset.arch}) cannot be written as arch {final_arch!r}; "
                         f"the dense presets swap between {', '.join(DENSE_ARCHITECTURES)}")
    if vocab_size_override is not None:
        vocab_size = vocab_size_override
    elif preset.vocab_size is not None:
        vocab_size = max(preset.vocab_size, tokenizer_vocab)
    else:
        vocab_size = tokenizer_vocab
    if (final_arch in ("qwen3", "qwen3_moe", "gemma3", "gpt_oss", "qwen3_5", "qwen3_5_moe", "nemotron_h")
            and preset.qwen3_head_dim is not None):
        head_dim = preset.qwen3_head_dim
    else:
        head_dim = preset.hidden_size // preset.num_attention_heads
    return ResolvedModel(preset=preset, arch=final_arch, vocab_size=vocab_size, head_dim=head_dim, dtype=dtype)


def build_config(model: ResolvedModel) -> dict:
    """config.json contents in HF format for ``model``."""
    preset = model.preset
    config: dict = {
        "architectures": [ARCHITECTURES[model.arch]],
        "model_type": model.arch,
        "vocab_size": model.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_theta": preset.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "initializer_range": INIT_STD,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": model.dtype,
        "bos_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
        "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)],
        "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
        "kvreuse_preset": preset.name,
        "kvreuse_recipe_version": RECIPE_VERSION,
    }
    if model.arch == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
        config["pretraining_tp"] = 1
        if preset.llama3_original_max_position is not None:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": preset.max_position_embeddings / preset.llama3_original_max_position,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": preset.llama3_original_max_position,
            }
    elif model.arch == "mistral":
        config["sliding_window"] = None
    elif model.arch in ("qwen2", "qwen3", "qwen3_moe"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = preset.num_hidden_layers
        if model.arch in ("qwen3", "qwen3_moe"):
            config["attention_bias"] = False
        if model.arch == "qwen3_moe":
            config.update(num_experts=preset.num_experts, num_experts_per_tok=preset.num_experts_per_tok,
                          moe_intermediate_size=preset.moe_intermediate_size, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
    elif model.arch == "gpt_oss":
        # The spellings of gpt-oss-20b's released config.json (rope_scaling with rope_theta beside it).
        config.update(
            attention_bias=True, sliding_window=preset.sliding_window,
            layer_types=["sliding_attention" if (layer + 1) % 2 else "full_attention"
                         for layer in range(preset.num_hidden_layers)],
            num_local_experts=preset.num_experts, num_experts_per_tok=preset.num_experts_per_tok,
            experts_per_token=preset.num_experts_per_tok, router_aux_loss_coef=0.9, output_router_logits=False,
            swiglu_limit=7.0, rope_scaling={
                "rope_type": "yarn", "factor": preset.max_position_embeddings / preset.yarn_original_max_position,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": preset.yarn_original_max_position},
        )
    elif model.arch == "lfm2":
        # The spellings of LFM2's released config.json (read by transformers' Lfm2Config and llama.cpp's converter).
        for key in ("head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "attention_dropout"):
            del config[key]
        config.update(
            norm_eps=preset.rms_norm_eps, conv_L_cache=preset.conv_kernel, conv_bias=False,
            # The released files' own spellings too (vLLM's LFM2 reads them): the same numbers.
            conv_dim=preset.hidden_size, conv_dim_out=preset.hidden_size, block_dim=preset.hidden_size,
            block_ff_dim=preset.intermediate_size, block_norm_eps=preset.rms_norm_eps,
            num_heads=preset.num_attention_heads, theta=preset.rope_theta,
            tie_embedding=preset.tie_word_embeddings, use_pos_enc=True,
            block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
            rope_parameters={"rope_theta": preset.rope_theta, "rope_type": "default"},
            layer_types=["full_attention" if layer in preset.attention_layers else "conv"
                         for layer in range(preset.num_hidden_layers)],
        )
    elif model.arch in ("qwen3_5", "qwen3_5_moe"):
        # transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig spellings (rope_parameters with the partial rotary
        # factor inside).
        key_heads, value_heads, key_dim, value_dim = preset.delta_heads
        del config["rope_theta"], config["rope_scaling"]
        if model.arch == "qwen3_5_moe":
            del config["intermediate_size"]
            config.update(num_experts=preset.num_experts, num_experts_per_tok=preset.num_experts_per_tok,
                          moe_intermediate_size=preset.moe_intermediate_size, router_aux_loss_coef=0.001,
                          shared_expert_intermediate_size=preset.shared_expert_intermediate_size)
        config.update(
            model_type="qwen3_5_moe_text" if model.arch == "qwen3_5_moe" else "qwen3_5_text", attention_bias=False,
            linear_conv_kernel_dim=preset.conv_kernel,
            linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=key_dim,
            linear_value_head_dim=value_dim, full_attention_interval=4,
            rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta,
                             "partial_rotary_factor": preset.partial_rotary_factor},
            layer_types=["full_attention" if layer in preset.attention_layers else "linear_attention"
                         for layer in range(preset.num_hidden_layers)],
        )
    elif model.arch == "nemotron_h":
        # The spellings of Nemotron-H's released config.json (transformers' NemotronHConfig and llama.cpp's converter
        # read them: the converter takes its layers from hybrid_override_pattern, and a num_experts_per_tok key for
        # the MoE variant's, so none is written).
        heads, head_dim, groups, state_size = preset.mamba_shape
        for key in ("hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling"):
            del config[key]
        config.update(
            hybrid_override_pattern=preset.hybrid_pattern, layer_norm_epsilon=preset.rms_norm_eps,
            mlp_hidden_act="relu2", mamba_hidden_act="silu", attention_bias=False, mlp_bias=False, use_bias=False,
            mamba_num_heads=heads, mamba_head_dim=head_dim, n_groups=groups, ssm_state_size=state_size,
            expand=heads * head_dim // preset.hidden_size, conv_kernel=preset.conv_kernel, use_conv_bias=True,
            chunk_size=128, time_step_limit=[0.0, float("inf")], time_step_min=0.001, time_step_max=0.1,
            time_step_floor=0.0001, residual_in_fp32=False, rescale_prenorm_residual=True,
        )
    elif model.arch == "gemma3":
        # The spellings Gemma 3's released config.json files use (llama.cpp's converter reads these), and the
        # layer_types transformers 5 writes.
        pattern = preset.sliding_window_pattern
        del config["hidden_act"]
        config.update(
            model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", attention_bias=False,
            sliding_window=preset.sliding_window, sliding_window_pattern=pattern,
            layer_types=["full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"
                         for layer in range(preset.num_hidden_layers)],
            rope_local_base_freq=10000.0, query_pre_attn_scalar=preset.query_pre_attn_scalar,
            final_logit_softcapping=None, attn_logit_softcapping=None,
        )
    return config


def weight_specs(model: ResolvedModel) -> list[TensorSpec]:
    """HF parameter names and shapes, in the order they are written."""
    preset = model.preset
    hidden, head_dim = preset.hidden_size, model.head_dim
    q_size = preset.num_attention_heads * head_dim
    kv_size = preset.num_key_value_heads * head_dim
    gemma = model.arch == "gemma3"
    norm_init = "zeros" if gemma else "ones"
    specs = [TensorSpec("model.embed_tokens.weight", (model.vocab_size, hidden), "normal")]
    if model.arch == "lfm2":
        return specs + _lfm2_weight_specs(model)
    if model.arch in ("qwen3_5", "qwen3_5_moe"):
        return specs + _qwen3_5_weight_specs(model)
    if model.arch == "nemotron_h":
        return _nemotron_h_weight_specs(model)
    for layer in range(preset.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        specs.append(TensorSpec(f"{prefix}.input_layernorm.weight", (hidden,), norm_init))
        specs.append(TensorSpec(f"{prefix}.self_attn.q_proj.weight", (q_size, hidden), "normal"))
        specs.append(TensorSpec(f"{prefix}.self_attn.k_proj.weight", (kv_size, hidden), "normal"))
        specs.append(TensorSpec(f"{prefix}.self_attn.v_proj.weight", (kv_size, hidden), "normal"))
        if model.arch == "qwen2":
            # Random (not zero) biases so a loader that drops them produces visibly wrong logits.
            specs.append(TensorSpec(f"{prefix}.self_attn.q_proj.bias", (q_size,), "normal"))
            specs.append(TensorSpec(f"{prefix}.self_attn.k_proj.bias", (kv_size,), "normal"))
            specs.append(TensorSpec(f"{prefix}.self_attn.v_proj.bias", (kv_size,), "normal"))
        if model.arch == "gpt_oss":
            specs.append(TensorSpec(f"{prefix}.self_attn.q_proj.bias", (q_size,), "normal"))
            specs.append(TensorSpec(f"{prefix}.self_attn.k_proj.bias", (kv_size,), "normal"))
            specs.append(TensorSpec(f"{prefix}.self_attn.v_proj.bias", (kv_size,), "normal"))
            specs.append(TensorSpec(f"{prefix}.self_attn.o_proj.bias", (hidden,), "normal"))
            specs.append(TensorSpec(f"{prefix}.self_attn.sinks", (preset.num_attention_heads,), "normal"))
        if model.arch in ("qwen3", "qwen3_moe", "gemma3"):
            specs.append(TensorSpec(f"{prefix}.self_attn.q_norm.weight", (head_dim,), norm_init))
            specs.append(TensorSpec(f"{prefix}.self_attn.k_norm.weight", (head_dim,), norm_init))
        specs.append(TensorSpec(f"{prefix}.self_attn.o_proj.weight", (hidden, q_size), "normal"))
        specs.append(TensorSpec(f"{prefix}.post_attention_layernorm.weight", (hidden,), norm_init))
        if gemma:
            specs.append(TensorSpec(f"{prefix}.pre_feedforward_layernorm.weight", (hidden,), norm_init))
            specs.append(TensorSpec(f"{prefix}.post_feedforward_layernorm.weight", (hidden,), norm_init))
        if model.arch == "qwen3_moe":
            experts, size = preset.num_experts, preset.moe_intermediate_size
            specs.append(TensorSpec(f"{prefix}.mlp.gate.weight", (experts, hidden), "normal"))
            for expert in range(experts):
                specs.append(TensorSpec(f"{prefix}.mlp.experts.{expert}.gate_proj.weight", (size, hidden), "normal"))
                specs.append(TensorSpec(f"{prefix}.mlp.experts.{expert}.up_proj.weight", (size, hidden), "normal"))
                specs.append(TensorSpec(f"{prefix}.mlp.experts.{expert}.down_proj.weight", (hidden, size), "normal"))
            continue
        if model.arch == "gpt_oss":
            # transformers' stacked layout: gate_up [E, hidden, 2I] with gate and up interleaved along the last
            # dim, down [E, I, hidden] (x @ W + b), a biased router.
            experts, size = preset.num_experts, preset.intermediate_size
            specs.append(TensorSpec(f"{prefix}.mlp.router.weight", (experts, hidden), "normal"))
            specs.append(TensorSpec(f"{prefix}.mlp.router.bias", (experts,), "normal"))
            specs.append(TensorSpec(f"{prefix}.mlp.experts.gate_up_proj", (experts, hidden, 2 * size), "normal"))
            specs.append(TensorSpec(f"{prefix}.mlp.experts.gate_up_proj_bias", (experts, 2 * size), "normal"))
            specs.append(TensorSpec(f"{prefix}.mlp.experts.down_proj", (experts, size, hidden), "normal"))
            specs.append(TensorSpec(f"{prefix}.mlp.experts.down_proj_bias", (experts, hidden), "normal"))
            continue
        specs.append(TensorSpec(f"{prefix}.mlp.gate_proj.weight", (preset.intermediate_size, hidden), "normal"))
        specs.append(TensorSpec(f"{prefix}.mlp.up_proj.weight", (preset.intermediate_size, hidden), "normal"))
        specs.append(TensorSpec(f"{prefix}.mlp.down_proj.weight", (hidden, preset.intermediate_size), "normal"))
    specs.append(TensorSpec("model.norm.weight", (hidden,), norm_init))
    if not preset.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (model.vocab_size, hidden), "normal"))
    return specs


def _lfm2_weight_specs(model: ResolvedModel) -> list[TensorSpec]:
    """LFM2's layers under its own names (after the embedding), and its final norm."""
    preset = model.preset
    hidden, head_dim = preset.hidden_size, model.head_dim
    width = ModelConfig.from_dict(build_config(model)).intermediate_size  # as LFM2 adjusts it
    specs = []
    for layer in range(preset.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        specs.append(TensorSpec(f"{prefix}.operator_norm.weight", (hidden,), "ones"))
        if layer in preset.attention_layers:
            specs += [
                TensorSpec(f"{prefix}.self_attn.q_proj.weight", (preset.num_attention_heads * head_dim, hidden), "normal"),
                TensorSpec(f"{prefix}.self_attn.k_proj.weight", (preset.num_key_value_heads * head_dim, hidden), "normal"),
                TensorSpec(f"{prefix}.self_attn.v_proj.weight", (preset.num_key_value_heads * head_dim, hidden), "normal"),
                TensorSpec(f"{prefix}.self_attn.out_proj.weight", (hidden, preset.num_attention_heads * head_dim), "normal"),
                TensorSpec(f"{prefix}.self_attn.q_layernorm.weight", (head_dim,), "ones"),
                TensorSpec(f"{prefix}.self_attn.k_layernorm.weight", (head_dim,), "ones"),
            ]
        else:
            specs += [
                TensorSpec(f"{prefix}.conv.in_proj.weight", (3 * hidden, hidden), "normal"),
                TensorSpec(f"{prefix}.conv.conv.weight", (hidden, 1, preset.conv_kernel), "normal"),
                TensorSpec(f"{prefix}.conv.out_proj.weight", (hidden, hidden), "normal"),
            ]
        specs += [
            TensorSpec(f"{prefix}.ffn_norm.weight", (hidden,), "ones"),
            TensorSpec(f"{prefix}.feed_forward.w1.weight", (width, hidden), "normal"),
            TensorSpec(f"{prefix}.feed_forward.w3.weight", (width, hidden), "normal"),
            TensorSpec(f"{prefix}.feed_forward.w2.weight", (hidden, width), "normal"),
        ]
    specs.append(TensorSpec("model.embedding_norm.weight", (hidden,), "ones"))
    return specs


def _qwen3_5_weight_specs(model: ResolvedModel) -> list[TensorSpec]:
    """Qwen3.5's layers under transformers' names (after the embedding), and its final norm: every norm but the Gated
    DeltaNet's output norm scales by (1 + weight), so it is written as zeros."""
    preset = model.preset
    hidden, head_dim = preset.hidden_size, model.head_dim
    key_heads, value_heads, key_dim, value_dim = preset.delta_heads
    conv_dim, value_size = 2 * key_heads * key_dim + value_heads * value_dim, value_heads * value_dim
    q_size, kv_size = preset.num_attention_heads * head_dim, preset.num_key_value_heads * head_dim
    specs = []
    for layer in range(preset.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        specs.append(TensorSpec(f"{prefix}.input_layernorm.weight", (hidden,), "zeros"))
        if layer in preset.attention_layers:
            specs += [
                TensorSpec(f"{prefix}.self_attn.q_proj.weight", (2 * q_size, hidden), "normal"),
                TensorSpec(f"{prefix}.self_attn.k_proj.weight", (kv_size, hidden), "normal"),
                TensorSpec(f"{prefix}.self_attn.v_proj.weight", (kv_size, hidden), "normal"),
                TensorSpec(f"{prefix}.self_attn.o_proj.weight", (hidden, q_size), "normal"),
                TensorSpec(f"{prefix}.self_attn.q_norm.weight", (head_dim,), "zeros"),
                TensorSpec(f"{prefix}.self_attn.k_norm.weight", (head_dim,), "zeros"),
            ]
        else:
            specs += [
                TensorSpec(f"{prefix}.linear_attn.in_proj_qkv.weight", (conv_dim, hidden), "normal"),
                TensorSpec(f"{prefix}.linear_attn.in_proj_z.weight", (value_size, hidden), "normal"),
                TensorSpec(f"{prefix}.linear_attn.in_proj_b.weight", (value_heads, hidden), "normal"),
                TensorSpec(f"{prefix}.linear_attn.in_proj_a.weight", (value_heads, hidden), "normal"),
                TensorSpec(f"{prefix}.linear_attn.conv1d.weight", (conv_dim, 1, preset.conv_kernel), "normal"),
                TensorSpec(f"{prefix}.linear_attn.dt_bias", (value_heads,), "ones"),
                TensorSpec(f"{prefix}.linear_attn.A_log", (value_heads,), "normal"),
                TensorSpec(f"{prefix}.linear_attn.norm.weight", (value_dim,), "ones"),
                TensorSpec(f"{prefix}.linear_attn.out_proj.weight", (hidden, value_size), "normal"),
            ]
        if model.arch == "qwen3_5_moe":
            # transformers' stacked experts (gate rows then up rows), the router, the shared expert and its gate
            experts, size, shared = preset.num_experts, preset.moe_intermediate_size, preset.shared_expert_intermediate_size
            specs += [
                TensorSpec(f"{prefix}.post_attention_layernorm.weight", (hidden,), "zeros"),
                TensorSpec(f"{prefix}.mlp.gate.weight", (experts, hidden), "normal"),
                TensorSpec(f"{prefix}.mlp.experts.gate_up_proj", (experts, 2 * size, hidden), "normal"),
                TensorSpec(f"{prefix}.mlp.experts.down_proj", (experts, hidden, size), "normal"),
                TensorSpec(f"{prefix}.mlp.shared_expert.gate_proj.weight", (shared, hidden), "normal"),
                TensorSpec(f"{prefix}.mlp.shared_expert.up_proj.weight", (shared, hidden), "normal"),
                TensorSpec(f"{prefix}.mlp.shared_expert.down_proj.weight", (hidden, shared), "normal"),
                TensorSpec(f"{prefix}.mlp.shared_expert_gate.weight", (1, hidden), "normal"),
            ]
            continue
        specs += [
            TensorSpec(f"{prefix}.post_attention_layernorm.weight", (hidden,), "zeros"),
            TensorSpec(f"{prefix}.mlp.gate_proj.weight", (preset.intermediate_size, hidden), "normal"),
            TensorSpec(f"{prefix}.mlp.up_proj.weight", (preset.intermediate_size, hidden), "normal"),
            TensorSpec(f"{prefix}.mlp.down_proj.weight", (hidden, preset.intermediate_size), "normal"),
        ]
    specs.append(TensorSpec("model.norm.weight", (hidden,), "zeros"))
    if not preset.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (model.vocab_size, hidden), "normal"))
    return specs


def _nemotron_h_weight_specs(model: ResolvedModel) -> list[TensorSpec]:
    """Nemotron-H's tensors under its released files' names (``backbone.``): one mixer a layer, by the pattern. A
    Mamba-2 layer's A_log is written as log(1 .. heads) and its D and dt_bias as ones (transformers' init): a random
    A_log near 0 would give every head the same decay."""
    preset = model.preset
    hidden, head_dim = preset.hidden_size, model.head_dim
    heads, mamba_head_dim, groups, state_size = preset.mamba_shape
    inner = heads * mamba_head_dim
    conv_dim = inner + 2 * groups * state_size
    specs = [TensorSpec("backbone.embeddings.weight", (model.vocab_size, hidden), "normal")]
    for layer, kind in enumerate(preset.hybrid_pattern):
        prefix = f"backbone.layers.{layer}"
        specs.append(TensorSpec(f"{prefix}.norm.weight", (hidden,), "ones"))
        if kind == "M":
            specs += [
                TensorSpec(f"{prefix}.mixer.in_proj.weight", (inner + conv_dim + heads, hidden), "normal"),
                TensorSpec(f"{prefix}.mixer.conv1d.weight", (conv_dim, 1, preset.conv_kernel), "normal"),
                TensorSpec(f"{prefix}.mixer.conv1d.bias", (conv_dim,), "normal"),
                TensorSpec(f"{prefix}.mixer.dt_bias", (heads,), "ones"),
                TensorSpec(f"{prefix}.mixer.A_log", (heads,), "log_range"),
                TensorSpec(f"{prefix}.mixer.D", (heads,), "ones"),
                TensorSpec(f"{prefix}.mixer.norm.weight", (inner,), "ones"),
                TensorSpec(f"{prefix}.mixer.out_proj.weight", (hidden, inner), "normal"),
            ]
        elif kind == "*":
            q_size, kv_size = preset.num_attention_heads * head_dim, preset.num_key_value_heads * head_dim
            specs += [
                TensorSpec(f"{prefix}.mixer.q_proj.weight", (q_size, hidden), "normal"),
                TensorSpec(f"{prefix}.mixer.k_proj.weight", (kv_size, hidden), "normal"),
                TensorSpec(f"{prefix}.mixer.v_proj.weight", (kv_size, hidden), "normal"),
                TensorSpec(f"{prefix}.mixer.o_proj.weight", (hidden, q_size), "normal"),
            ]
        else:
            specs += [
                TensorSpec(f"{prefix}.mixer.up_proj.weight", (preset.intermediate_size, hidden), "normal"),
                TensorSpec(f"{prefix}.mixer.down_proj.weight", (hidden, preset.intermediate_size), "normal"),
            ]
    specs.append(TensorSpec("backbone.norm_f.weight", (hidden,), "ones"))
    if not preset.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (model.vocab_size, hidden), "normal"))
    return specs


def count_parameters(preset: str, arch: str | None = None, vocab_size: int | None = None) -> int:
    """Parameters of ``preset`` (with ``arch``); ``vocab_size`` defaults to the preset's or 1024."""
    _check_choice("preset", preset, PRESETS)
    tokenizer_vocab = PRESETS[preset].tokenizer_vocab_size
    model = _resolve(preset, arch, "bfloat16", tokenizer_vocab, vocab_size)
    return sum(spec.numel for spec in weight_specs(model))


# ----------------------------------------------------------------------------------------------
# Weight generation and streaming safetensors writer


def _tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed: values depend on (seed, name) only, not on order or sharding."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generate_chunks(spec: TensorSpec, dtype: torch.dtype, seed: int) -> Iterator[torch.Tensor]:
    """The tensor's values as contiguous pieces along dim 0, each at most GENERATION_CHUNK_ELEMENTS."""
    if spec.init in ("ones", "zeros"):
        yield (torch.ones if spec.init == "ones" else torch.zeros)(spec.shape, dtype=dtype)
        return
    if spec.init == "log_range":
        yield torch.arange(1, spec.shape[0] + 1, dtype=torch.float32).log().to(dtype)
        return
    generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, spec.name))
    row_numel = math.prod(spec.shape[1:])
    rows_per_chunk = max(1, GENERATION_CHUNK_ELEMENTS // max(1, row_numel))
    for start in range(0, spec.shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, spec.shape[0] - start)
        values = torch.randn((rows, *spec.shape[1:]), generator=generator, dtype=torch.float32)
        yield values.mul_(INIT_STD).to(dtype)


def _write_safetensors(path: Path, specs: Sequence[TensorSpec], dtype: torch.dtype, seed: int) -> None:
    """Write one safetensors file tensor by tensor (header first: every size is known in advance)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        num_bytes = spec.numel * element_size
        header[spec.name] = {
            "dtype": SAFETENSORS_DTYPE_NAMES[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + num_bytes],
        }
        offset += num_bytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data section starts 8-byte aligned
    tmp_path = path.with_name(path.name + ".partial")
    with open(tmp_path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)))
        handle.write(header_bytes)
        for spec in specs:
            for chunk in _generate_chunks(spec, dtype, seed):
                handle.write(chunk.contiguous().view(-1).view(torch.uint8).numpy())
    os.replace(tmp_path, path)


def _split_into_shards(specs: Sequence[TensorSpec], element_size: int, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy in order, like HF: a tensor bigger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    shard_bytes = 0
    for spec in specs:
        spec_bytes = spec.numel * element_size
        if shards[-1] and shard_bytes + spec_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(spec)
        shard_bytes += spec_bytes
    return shards


def _write_weights(out_dir: Path, specs: Sequence[TensorSpec], dtype: torch.dtype, seed: int,
                   max_shard_bytes: int | None) -> list[str]:
    element_size = torch.empty((), dtype=dtype).element_size()
    total_bytes = sum(spec.numel for spec in specs) * element_size
    limit = max_shard_bytes if max_shard_bytes is not None else AUTO_SHARD_BYTES
    shards = _split_into_shards(specs, element_size, limit)
    if len(shards) == 1:
        _write_safetensors(out_dir / "model.safetensors", specs, dtype, seed)
        return ["model.safetensors"]
    file_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(file_names, shards):
        _write_safetensors(out_dir / file_name, shard, dtype, seed)
        weight_map.update({spec.name: file_name for spec in shard})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    _atomic_write_text(out_dir / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    return [*file_names, "model.safetensors.index.json"]


# ----------------------------------------------------------------------------------------------
# Folder assembly


def _tokenizer_config(max_length: int, tool_token_ids: dict[str, int],
                      harmony_token_ids: dict[str, int] | None = None, thinking: bool = False) -> dict:
    """tokenizer_config.json: ChatML's special tokens and template (``thinking``: Qwen3's, which drops earlier
    turns' thinking), or with ``harmony_token_ids`` (gpt-oss) harmony's, its end of a final answer as eos."""
    added_tokens = {
        str(token_id): {
            "content": token, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True,
        }
        for token_id, token in enumerate(SPECIAL_TOKENS)
    }
    for token, token_id in tool_token_ids.items():
        added_tokens[str(token_id)] = {
            "content": token, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": False,
        }
    for token, token_id in (harmony_token_ids or {}).items():
        added_tokens[str(token_id)] = {
            "content": token, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True,
        }
    if harmony_token_ids:
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added_tokens,
            "bos_token": None,
            "eos_token": HARMONY_RETURN,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "additional_special_tokens": list(HARMONY_TOKENS),
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_length,
            "split_special_tokens": False,
            "chat_template": HARMONY_TEMPLATE,
        }
    return {
        # Explicit class: a model-specific class (e.g. LlamaTokenizer chosen from model_type) would
        # rebuild the pipeline with its own pre-tokenizer instead of using tokenizer.json as is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": [IM_START, IM_END],
        # Cleanup would make decode context dependent and break streaming-equals-full-decode.
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "split_special_tokens": False,
        "chat_template": QWEN3_THINKING_TEMPLATE if thinking else CHATML_TEMPLATE,
    }


def _atomic_write_text(path: Path, text: str) -> None:
    tmp_path = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp_path.write_text(text, encoding="utf-8")
    os.replace(tmp_path, path)


def _write_json(path: Path, data: dict) -> None:
    _atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _remove_old_weights(out_dir: Path) -> None:
    """Drop weight files a previous run left (other sharding), so loaders never see two layouts."""
    for path in out_dir.iterdir():
        name = path.name
        is_weight_file = name == "model.safetensors" or name == "model.safetensors.index.json" or (
            name.startswith("model-") and name.endswith(".safetensors") and "-of-" in name
        )
        if is_weight_file and path.is_file():
            path.unlink()


def _check_choice(field: str, value: object, choices: dict) -> None:
    if value not in choices:
        raise ValueError(f"{field} must be one of {sorted(choices)}, got {value!r}")


def make_model(
    out_dir: str | os.PathLike[str],
    preset: str = "tiny",
    arch: str | None = None,
    dtype: str = "bfloat16",
    write_weights: bool | None = None,
    seed: int = 0,
    max_shard_size: int | str | None = None,
    vocab_size_override: int | None = None,
) -> Path:
    """Write a complete HF model folder for ``preset`` into ``out_dir`` and return its path.

    ``arch`` (llama, mistral, qwen2, qwen3) overrides a dense preset's architecture; the qwen3_moe, gemma3
    and gpt_oss presets are written as their own (gpt_oss with harmony's tokens and chat template). Weights are seeded normal(0, 0.02) (norm weights 1; Gemma's 0,
    which it reads as a scale of 1); ``write_weights=None`` writes them when the model has under
    1.5B parameters. ``max_shard_size`` (bytes or "500MB") splits weights into HF shards with an
    index. ``vocab_size_override`` sets config.json's vocab_size (the tokenizer is trained to at
    most that size, so the config vocab is never smaller than the tokenizer's).
    """
    _check_choice("preset", preset, PRESETS)
    if arch is not None:
        _check_choice("arch", arch, ARCHITECTURES)
    _check_choice("dtype", dtype, DTYPES)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    max_shard_bytes = None if max_shard_size is None else parse_memory_size(max_shard_size, "max_shard_size")
    if vocab_size_override is not None and (
        not isinstance(vocab_size_override, int) or vocab_size_override < MIN_TOKENIZER_VOCAB
    ):
        raise ValueError(
            f"vocab_size_override must be an int >= {MIN_TOKENIZER_VOCAB} (bytes + special tokens), "
            f"got {vocab_size_override!r}"
        )

    preset_spec = PRESETS[preset]
    harmony = preset_spec.arch == "gpt_oss"
    tokenizer_target = preset_spec.tokenizer_vocab_size
    if vocab_size_override is not None:
        tokenizer_target = min(tokenizer_target, vocab_size_override)
    if harmony:  # room for harmony's tokens, added after training
        tokenizer_target = max(MIN_TOKENIZER_VOCAB, tokenizer_target - len(HARMONY_TOKENS))
    tokenizer_json = trained_tokenizer_path(tokenizer_target)
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    harmony_ids: dict[str, int] = {}
    if harmony:
        harmony_ids = _write_harmony_tokenizer(tokenizer_json, out_path / "tokenizer.json")
    else:
        shutil.copyfile(tokenizer_json, out_path / "tokenizer.json")
    tokenizer_vocab = _tokenizer_vocab_size(out_path / "tokenizer.json")
    model = _resolve(preset, arch, dtype, tokenizer_vocab, vocab_size_override)
    if model.vocab_size < tokenizer_vocab:
        raise ValueError(f"vocab_size_override {vocab_size_override} is below the tokenizer's {tokenizer_vocab} "
                         "tokens (harmony's special tokens included)")

    _remove_old_weights(out_path)
    config = build_config(model)
    generation_eos = config["eos_token_id"]
    if harmony:
        # gpt-oss's own files: config.json's eos is <|return|>; generation stops on <|return|>, <|endoftext|>
        # and <|call|> (a tool call waits for its result).
        config["eos_token_id"] = harmony_ids[HARMONY_RETURN]
        generation_eos = [harmony_ids[HARMONY_RETURN], SPECIAL_TOKENS.index(ENDOFTEXT), harmony_ids[HARMONY_CALL]]
    _write_json(out_path / "config.json", config)
    _write_json(out_path / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": generation_eos,
        "pad_token_id": config["pad_token_id"],
    })
    _write_json(out_path / "tokenizer_config.json",
                _tokenizer_config(preset_spec.max_position_embeddings, _tool_token_ids(tokenizer_json),
                                  harmony_ids or None, thinking=preset_spec.thinking_template))
    _write_json(out_path / "special_tokens_map.json", {
        "eos_token": HARMONY_RETURN if harmony else IM_END,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": list(HARMONY_TOKENS) if harmony else [IM_START, IM_END],
    })

    specs = weight_specs(model)
    if write_weights is None:
        write_weights = sum(spec.numel for spec in specs) < DEFAULT_WRITE_WEIGHTS_MAX_PARAMS
    if write_weights:
        if sys.byteorder != "little":
            raise ValueError("writing safetensors needs a little-endian machine")
        _write_weights(out_path, specs, DTYPES[dtype], seed, max_shard_bytes)
    return out_path


def _tokenizer_vocab_size(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)


def _write_harmony_tokenizer(trained: Path, destination: Path) -> dict[str, int]:
    """The trained tokenizer with harmony's special tokens added as its last ids, written to ``destination``;
    returns their ids."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(trained))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in HARMONY_TOKENS])
    _atomic_write_text(destination, tokenizer.to_str(pretty=True))
    return {token: tokenizer.token_to_id(token) for token in HARMONY_TOKENS}


def _tool_token_ids(tokenizer_json: Path) -> dict[str, int]:
    added = json.loads(tokenizer_json.read_text(encoding="utf-8"))["added_tokens"]
    return {entry["content"]: entry["id"] for entry in added if entry["content"] in TOOL_TOKENS}


# ----------------------------------------------------------------------------------------------
# Command line


MAKE_MODEL_DESCRIPTION = "Make an HF model folder with random weights and a trained byte-level BPE tokenizer."


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvreuse make-model OUT``."""
    parser.add_argument("out", help="output folder (created if missing)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--arch", default=None, choices=sorted(ARCHITECTURES),
                        help="override the preset's architecture")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None,
                        help="split weights into shards of at most this size, e.g. 500MB or 1GiB")
    parser.add_argument("--vocab-size", type=int, default=None, dest="vocab_size_override",
                        help="config vocab_size (default: the preset's, or the tokenizer's for tiny)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--weights", dest="write_weights", action="store_true", default=None,
                         help="always write weights")
    weights.add_argument("--no-weights", dest="write_weights", action="store_false",
                         help="write config and tokenizer only (run with load_format=dummy)")
    parser.add_argument("--eagle-draft", default=None, metavar="DRAFT_OUT",
                        help="also write a random EAGLE draft for the model into this folder "
                             "(kvreuse distill-eagle trains a useful one)")
    parser.add_argument("--eagle-method", default="eagle", choices=["eagle", "eagle3"],
                        help="draft format for --eagle-draft (default: eagle, i.e. EAGLE-1/2)")


def run_make_model(args: argparse.Namespace) -> int:
    """Write the model folder ``args`` describe; returns the exit status (2 on bad options)."""
    try:
        out_path = make_model(
            args.out, preset=args.preset, arch=args.arch, dtype=args.dtype,
            write_weights=args.write_weights, seed=args.seed, max_shard_size=args.max_shard_size,
            vocab_size_override=args.vocab_size_override,
        )
    except ValueError as error:
        print(f"kvreuse make-model: error: {error}", file=sys.stderr)
        return 2
    config = json.loads((out_path / "config.json").read_text(encoding="utf-8"))
    weight_files = sorted(p.name for p in out_path.glob("*.safetensors"))
    num_params = count_parameters(args.preset, args.arch, config["vocab_size"])
    print(f"{out_path}: {config['architectures'][0]} preset={args.preset} params={num_params:,} "
          f"vocab={config['vocab_size']} dtype={args.dtype} "
          f"weights={', '.join(weight_files) if weight_files else 'none (use load_format=dummy)'}")
    if args.eagle_draft:
        from kvreuse.model_tools.make_draft import make_random_draft

        try:
            draft_path = make_random_draft(out_path, args.eagle_draft, method=args.eagle_method, seed=args.seed)
        except ValueError as error:
            print(f"kvreuse make-model: error: {error}", file=sys.stderr)
            return 2
        print(f"{draft_path}: random {args.eagle_method} draft for {out_path} (one decoder layer)")
    return 0


def main_make_model(argv: list[str] | None = None) -> int:
    """``python -m kvreuse.model_tools.make_model OUT [--preset ...]`` (the same as ``kvreuse make-model``)."""
    parser = argparse.ArgumentParser(prog="kvreuse make-model", description=MAKE_MODEL_DESCRIPTION)
    add_make_model_arguments(parser)
    return run_make_model(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main_make_model())
