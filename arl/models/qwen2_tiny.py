"""A Qwen2-shaped model folder built on the spot: the path a real user takes (`model.path=` a Qwen folder), small.

`build_qwen2_tiny_dir(path)` writes what a Qwen2.5-Instruct folder holds, small:

- a byte-level BPE tokenizer trained here with `tokenizers` (Qwen2's pre-tokenizer: its split regex, then
  ByteLevel without a prefix space; NFC normaliser; ByteLevel decoder), with Qwen's special tokens
  (`<|endoftext|>` = pad, `<|im_start|>`, `<|im_end|>` = eos) and `<tool_call>` / `</tool_call>` as added tokens
  that are NOT special (as in Qwen2.5: decoding with `skip_special_tokens=True` keeps them, so tool-call parsers
  still see the tags);
- Qwen2.5's chat template (tool schemas rendered into the system prompt from `apply_chat_template(tools=...)`,
  assistant `tool_calls` as `<tool_call>` blocks, consecutive `tool` messages folded into one user turn of
  `<tool_response>` blocks);
- a `Qwen2ForCausalLM` (GQA, tied embeddings; ~1M parameters by default) and a generation config whose eos is
  `<|im_end|>` and `<|endoftext|>`; random, or (with a `demo=`, `arl.recipes.tool_demo.ToolDemo`) taught one fixed
  tool conversation in a few seconds, so that it writes what a tool model writes: a `<tool_call>` block ended by
  <|im_end|>, then after the observation an answer ended by <|endoftext|> (`experiments.gsm8k.gsm8k_tool_demo()`:
  for the gsm8k experiment's prompts).

The folder loads with `AutoTokenizer` / `AutoModelForCausalLM` and with `PreTrainedTokenizerFast` (ARL's roles) and
both tokenize alike, because the tokenizer's pipeline is Qwen2's own and `tokenizer_config.json` names
`Qwen2Tokenizer` (a `qwen2` config makes `AutoTokenizer` build Qwen2's pre-tokenizer, see DESIGN.md: a different one
would be swapped out). The model will not learn anything in a run; it exercises tokenizer loading, the chat
template with tools, tool calls, stop tokens and eos handling end to end (tests/e2e/test_real_model_path.py, and
tests/inference/test_sglang_real.py on a real SGLang server).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Protocol

import torch

__all__ = ["QWEN25_CHAT_TEMPLATE", "QWEN2_SPLIT_REGEX", "SPECIAL_TOKENS", "TOOL_TOKENS", "build_qwen2_tokenizer",
           "build_qwen2_model", "build_qwen2_tiny_dir", "Teacher"]

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]  # ids 0..2 (ids of special tokens come first in the vocab)
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # added, not special (Qwen2.5)

# Qwen2's pre-tokenizer split (tokenizer.json of every Qwen2/2.5 model): contractions, letters, single digits,
# punctuation runs, newlines, spaces.
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")

DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5-Instruct's chat template (the tool-calling one), verbatim in what it renders.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- '" + DEFAULT_SYSTEM + "' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Text the BPE merges are learned from: the shapes a gsm8k tool run shows (chat scaffolding, tool schemas and
# calls, numbers, arithmetic words). Any text would do; this keeps prompts short.
_CORPUS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
    "<|im_start|>assistant\n",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n",
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression",'
    ' "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": '
    '["expression"]}}}',
    '{"name": "python", "arguments": {"code": "print(2 + 3)"}}',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "24 + 18"}}\n</tool_call>',
    "<tool_response>\n42\n</tool_response>",
    "Solve the math problem. You may call the calculator or python tools. Put the final answer in \\boxed{}.",
    "The answer is \\boxed{12}. He makes 24 + 18 = 42 muffins. After selling, 42 - 30 = 12 muffins are left.",
    "How many pages does she read in 2 weeks? A ticket costs $12. A family buys 5 tickets and pays with money.",
    "the of and to in is that for it with as was on be at by this had not are but from or have an they which one "
    "you were her all she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three",
]


def build_qwen2_tokenizer(vocab_size: int = 1024, extra_text: Iterable[str] = ()) -> Any:
    """A byte-level BPE tokenizer with Qwen2's pipeline and special tokens, trained here on a small corpus (plus
    `extra_text`); returns a `PreTrainedTokenizerFast` carrying Qwen2.5's chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(list(_CORPUS) + list(extra_text), trainer=trainer)
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=32768,
    )
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    return tok


def build_qwen2_model(vocab_size: int, *, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int = 512, max_position_embeddings: int = 4096,
                      pad_token_id: int = 0, eos_token_ids: Optional[list[int]] = None, seed: int = 0) -> Any:
    """A randomly initialised `Qwen2ForCausalLM` (GQA, tied embeddings, biased q/k/v as Qwen2 has); the global
    torch RNG is left untouched."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos = list(eos_token_ids or [])
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, use_sliding_window=False, bos_token_id=None, pad_token_id=pad_token_id,
                         eos_token_id=eos[0] if eos else None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=None, pad_token_id=pad_token_id,
                                               eos_token_id=eos if len(eos) > 1 else (eos[0] if eos else None))
    model.eval()
    return model


class Teacher(Protocol):
    """What `build_qwen2_tiny_dir` teaches the fresh model (`arl.recipes.tool_demo.ToolDemo`): the texts the BPE
    merges are also trained on, and the steps that imprint it. A protocol, so the model layer imports no recipe."""

    def texts(self) -> list[str]: ...

    def teach(self, model: Any, tok: Any, seed: int) -> float: ...


def build_qwen2_tiny_dir(path: str, *, vocab_size: int = 1024, hidden_size: int = 192, num_layers: int = 2,
                         intermediate_size: int = 576, seed: int = 0, demo: Optional[Teacher] = None) -> str:
    """Write a Qwen2.5-Instruct-shaped model folder (tokenizer + chat template + Qwen2 model) to `path`; with a
    `demo`, the model is first taught that tool conversation (a few seconds). Returns the absolute path.
    Deterministic for the same arguments (on one machine)."""
    # BPE merges from the demo's prompts too: shorter prompts, faster runs
    extra = demo.texts() if demo is not None else []
    tok = build_qwen2_tokenizer(vocab_size, extra)
    eos_ids = [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(PAD_TOKEN)]
    model = build_qwen2_model(len(tok), hidden_size=hidden_size, num_layers=num_layers, seed=seed,
                              intermediate_size=intermediate_size, pad_token_id=tok.pad_token_id,
                              eos_token_ids=eos_ids)
    if demo is not None:
        demo.teach(model, tok, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    _qwen2_tokenizer_class(path)
    return os.path.abspath(path)


def _qwen2_tokenizer_class(path: str) -> None:
    """Name the tokenizer class a Qwen folder names (`Qwen2Tokenizer`), so every loader treats it as Qwen's."""
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
