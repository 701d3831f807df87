"""The tool demo taught to the tiny Qwen2 model is a recipe: built from an experiment's system prompt, it gives
`build_qwen2_tiny_dir` the texts its tokenizer also learns from and the steps that teach it."""

from __future__ import annotations

import json

from arl.recipes.tool_demo import GSM8K_SAMPLE, ToolDemo, tool_demo


def test_tool_demo_uses_the_given_system_prompt_and_the_tools_schemas() -> None:
    demo = tool_demo("SYSTEM", num_prompts=2, steps=5)
    with open(GSM8K_SAMPLE) as f:
        first = json.loads(f.readline())["prompt"]
    assert isinstance(demo, ToolDemo) and demo.steps == 5
    assert len(demo.prompts) == 2 and demo.prompts[0] == [{"role": "system", "content": "SYSTEM"},
                                                           {"role": "user", "content": first}]
    assert [t["function"]["name"] for t in demo.tools] == ["calculator"]
    texts = demo.texts()
    assert texts[0] == json.dumps(demo.tools[0]) and "SYSTEM" in texts and first in texts


def test_the_gsm8k_experiment_names_its_own_system_prompt() -> None:
    from experiments.gsm8k import SYSTEM_PROMPT, gsm8k_tool_demo

    assert gsm8k_tool_demo(num_prompts=1).prompts[0][0]["content"] == SYSTEM_PROMPT


def test_build_qwen2_tiny_dir_learns_the_demo_texts_and_teaches_it(tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    from arl.models.qwen2_tiny import build_qwen2_tiny_dir

    taught = []

    class Recorded(ToolDemo):
        def teach(self, model, tok, seed):
            taught.append(seed)
            return super().teach(model, tok, seed)

    demo = Recorded(prompts=tool_demo("zqxzqxzqx " * 20, num_prompts=1).prompts, steps=2, prefix_every=1)
    path = build_qwen2_tiny_dir(str(tmp_path / "m"), vocab_size=600, hidden_size=32, intermediate_size=64, seed=3,
                                demo=demo)
    assert taught == [3]
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    assert len(tok.tokenize(" zqxzqxzqx")) <= 3  # BPE merges learned from the demo's texts (10 pieces without)
