"""`export_final`: the run's `final/` folder (model + base tokenizer files + generation config), and the stop ids
every eos of a model folder gives the engines."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from arl.learner.export import EXPORT_INFO_FILE, export_final
from arl.models.qwen2_tiny import build_qwen2_tiny_dir
from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir, stop_token_ids

torch.set_num_threads(1)

GEN = {"max_new_tokens": 24, "min_new_tokens": 0, "temperature": 0.7, "top_p": 0.9, "top_k": 0}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return build_qwen2_tiny_dir(str(tmp_path_factory.mktemp("q") / "model"), hidden_size=32, intermediate_size=64)


def trained_state(model_dir: str, seed: int = 5) -> dict[str, torch.Tensor]:
    """The base model's weights, moved (as a learner step would)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # tied parameters stay tied
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}  # as the learner exports


def test_final_folder_from_a_weights_file_loads_as_is(tmp_path, qwen_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    sd = trained_state(qwen_dir)
    wfile = str(tmp_path / "v7.safetensors")
    save_file(sd, wfile, metadata={"format": "pt", "version": "7"})
    out = export_final(wfile, qwen_dir, str(tmp_path / "run" / "final"), gen=GEN)
    assert out == str(tmp_path / "run" / "final") and os.listdir(tmp_path / "run") == ["final"]  # no temp left
    model = AutoModelForCausalLM.from_pretrained(out)
    loaded = model.state_dict()
    assert "lm_head.weight" in sd and all(loaded[k].equal(v) for k, v in sd.items())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        with open(os.path.join(qwen_dir, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name
    tok = AutoTokenizer.from_pretrained(out)
    assert "<tool_call>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                   tools=[{"type": "function", "function": {"name": "f"}}])
    gen = GenerationConfig.from_pretrained(out)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert gen.eos_token_id == [im_end, eot] and gen.pad_token_id == eot
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.max_new_tokens) == (True, 0.7, 0.9, 24)
    assert gen.top_k is None or gen.top_k == 50  # ARL's top_k=0 (off) is not written as 0
    with open(os.path.join(out, "generation_config.json")) as f:
        assert "top_k" not in json.load(f)
    with open(os.path.join(out, EXPORT_INFO_FILE)) as f:
        assert json.load(f)["version"] == 7


def test_bf16_weights_keep_their_dtype_and_a_second_export_replaces_the_folder(tmp_path, qwen_dir):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "final")
    export_final(trained_state(qwen_dir, 1), qwen_dir, out)
    sd = {k: v.to(torch.bfloat16) for k, v in trained_state(qwen_dir, 2).items()}
    export_final(sd, qwen_dir, out, version=3)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert model.model.norm.weight.equal(sd["model.norm.weight"])
    assert sorted(os.listdir(tmp_path)) == ["final"]


def test_weights_of_another_model_are_refused(tmp_path, qwen_dir):
    sd = trained_state(qwen_dir)
    sd.pop("model.norm.weight")
    sd["extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="do not fit"):
        export_final(sd, qwen_dir, str(tmp_path / "final"))
    sd = trained_state(qwen_dir)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="tied parameters"):
        export_final(sd, qwen_dir, str(tmp_path / "final"))
    assert not os.path.exists(tmp_path / "final") and os.listdir(tmp_path) == []


def test_engine_with_no_weights_on_this_rank_writes_nothing(tmp_path, qwen_dir):
    class FollowerRank:
        def full_state_dict(self) -> None:
            return None

    assert export_final(FollowerRank(), qwen_dir, str(tmp_path / "final")) is None
    assert os.listdir(tmp_path) == []


def test_stop_token_ids_are_every_eos_of_the_folder(tmp_path, qwen_dir):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(qwen_dir)
    assert stop_token_ids(qwen_dir) == [tok.convert_tokens_to_ids("<|im_end|>"),
                                        tok.convert_tokens_to_ids("<|endoftext|>")]
    char = build_char_tokenizer()
    d = save_model_dir(build_tiny_model(len(char)), char, str(tmp_path / "tiny"))
    assert stop_token_ids(d) == [char.eos_token_id]  # the tiny model: one eos, as before
