"""A tiny, fully local model + tokenizer pair (no model hub needed).

The tokenizer is character-level (a `tokenizers` WordLevel model over single characters) wrapped in
`PreTrainedTokenizerFast`, with a chat template:

    user message       -> "<|user|>{content}"
    assistant message  -> "<|assistant|>{content}<eos>"
    system message     -> "{content}" (plain text prefix)
    tool message       -> "<|user|><tool_response>{content}</tool_response>" (a tool's observation, hermes style)
    add_generation_prompt=True appends "<|assistant|>"

so `[{"role": "user", "content": "12+7="}]` with a generation prompt renders as `<|user|>12+7=<|assistant|>`
and the model answers `19<eos>`. Decoding concatenates characters (spaces and newlines survive a round trip).

The model is a small Llama (`LlamaForCausalLM`, tied embeddings). Always load the tokenizer with
`PreTrainedTokenizerFast.from_pretrained` (see `load_model_dir`): `AutoTokenizer` may substitute a
model-specific pre-tokenizer.
"""

from __future__ import annotations

import contextlib
import os
import string
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]  # ids 0..4 in this order
CHARS = string.digits + string.ascii_letters + " +-*/=.,!?:'()\n"
TOOL_CHARS = '<>{}[]"_#%^&|;$@~`\\'  # extra characters hermes-style tool calls need: build_char_tokenizer(TOOL_CHARS)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}" + USER_TOKEN + "{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}" + ASSISTANT_TOKEN + "{{ message['content'] }}" + EOS_TOKEN +
    "{%- elif message['role'] == 'system' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'tool' -%}" + USER_TOKEN + "<tool_response>{{ message['content'] }}</tool_response>"
    "{%- else -%}{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT_TOKEN + "{%- endif -%}"
)


def build_char_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """Character-level tokenizer: <pad>=0, <eos>=1, <unk>=2, <|user|>=3, <|assistant|>=4, then one id per char."""
    chars = list(dict.fromkeys(CHARS + extra_chars))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char is one "word"
    tk.decoder = decoders.Fuse()  # join tokens without separators
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN,
                                  additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN],
                                  clean_up_tokenization_spaces=False, padding_side="left", model_max_length=1 << 30)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int = 0,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    tie_word_embeddings: bool = True,
) -> LlamaForCausalLM:
    """A randomly initialised small Llama. Defaults: ~0.34M params with the char vocab (82 tokens).

    The defaults for pad/eos ids match `build_char_tokenizer`. The global torch RNG is left untouched.
    """
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                         pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None, rms_norm_eps=1e-6)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    _sync_special_ids(model, pad_token_id, eos_token_id)
    model.eval()
    return model


def _sync_special_ids(model: Any, pad_token_id: int | None, eos_token_id: int | None) -> None:
    model.config.pad_token_id = pad_token_id
    model.config.eos_token_id = eos_token_id
    gc = getattr(model, "generation_config", None)
    if gc is None:
        gc = model.generation_config = GenerationConfig()
    gc.pad_token_id = pad_token_id
    gc.eos_token_id = eos_token_id
    gc.bos_token_id = None


def save_model_dir(model: Any, tokenizer: PreTrainedTokenizerFast, path: str) -> str:
    """Save model (safetensors) and tokenizer into one HF folder; special ids are synced from the tokenizer."""
    os.makedirs(path, exist_ok=True)
    _sync_special_ids(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_model_dir(path: str, *, dtype: torch.dtype = torch.float32) -> tuple[Any, PreTrainedTokenizerFast]:
    """Load `(model, tokenizer)` from a folder written by `save_model_dir` (or any HF causal-LM folder)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if tokenizer.pad_token_id is not None or tokenizer.eos_token_id is not None:
        _sync_special_ids(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    model.eval()
    return model, tokenizer


def stop_token_ids(model_dir: str) -> list[int]:
    """Every token id that ends a turn for the model in `model_dir`: the tokenizer's eos, then the eos ids of its
    generation config and model config (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>), in that order."""
    import json

    ids: list[int] = []

    def add(v: Any) -> None:
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(t, int) and t >= 0 and t not in ids:
                ids.append(t)

    with contextlib.suppress(OSError, ValueError):
        add(PreTrainedTokenizerFast.from_pretrained(model_dir).eos_token_id)
    for name in ("generation_config.json", "config.json"):
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(model_dir, name)) as f:
                add(json.load(f).get("eos_token_id"))
    return ids
