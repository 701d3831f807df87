import torch

from arl.models.tiny import build_char_tokenizer, build_tiny_model, load_model_dir, save_model_dir

torch.set_num_threads(1)


def test_round_trip_and_special_ids():
    tok = build_char_tokenizer()
    for text in ["12+7=19", "Hello,  World! (a-b)*c/d: it's?\n ok.", " leading and trailing "]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)  # one token per char
        assert tok.decode(ids) == text
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    assert tok.eos_token == "<eos>" and tok.eos_token_id == 1
    assert tok.convert_tokens_to_ids("<|user|>") == 3 and tok.convert_tokens_to_ids("<|assistant|>") == 4
    ids = tok.encode("<|user|>1+2=<|assistant|>3<eos>", add_special_tokens=False)
    assert ids[0] == 3 and ids[-1] == 1 and len(ids) == 8
    assert tok.decode(ids, skip_special_tokens=True) == "1+2=3"
    assert tok.decode(tok.encode("é", add_special_tokens=False)) == "<unk>"


def test_chat_template():
    tok = build_char_tokenizer()
    user = [{"role": "user", "content": "12+7="}]
    assert tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False) == "<|user|>12+7=<|assistant|>"
    conv = user + [{"role": "assistant", "content": "19"}, {"role": "user", "content": "Wrong, try again."}]
    text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>12+7=<|assistant|>19<eos><|user|>Wrong, try again.<|assistant|>"
    # the generation prompt is a prefix of the rendered answer: the model generates "19<eos>" after it
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": "19"}], tokenize=False)
    assert full == "<|user|>12+7=<|assistant|>19<eos>"


def test_model_size_save_load(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok))
    n = sum(p.numel() for p in model.parameters())
    assert 250_000 < n < 700_000, n
    assert model.config.pad_token_id == 0 and model.config.eos_token_id == 1
    assert model.generation_config.eos_token_id == 1 and model.generation_config.pad_token_id == 0
    # deterministic init, global RNG untouched
    state = torch.random.get_rng_state()
    again = build_tiny_model(len(tok))
    assert torch.equal(state, torch.random.get_rng_state())
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight)

    path = save_model_dir(model, tok, str(tmp_path / "m"))
    model2, tok2 = load_model_dir(path)
    assert tok2.chat_template == tok.chat_template
    text = "<|user|>3+4=<|assistant|>7<eos>"
    assert tok2.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert tok2.decode(tok2.encode(" a  b ", add_special_tokens=False)) == " a  b "
    assert model2.config.pad_token_id == 0 and model2.generation_config.eos_token_id == 1
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, model2(ids).logits, atol=1e-6)
