import pytest

from weir.data.prompts import PromptTooLong, encode_prompt, render_prompt
from weir.tasks.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_chat_template(tok):
    ids = encode_prompt(tok, {"prompt": "47+85"})
    assert tok.decode(ids) == "<|user|>47+85<|end|><|assistant|>"
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert len(ids) == 1 + 5 + 1 + 1  # byte-level: one token per character


def test_system_prompt_and_messages(tok):
    text = render_prompt(tok, {"prompt": "hi"}, system_prompt="be brief")
    assert text == "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert render_prompt(tok, {"messages": chat}) == (
        "<|user|>a<|end|><|assistant|>b<|end|><|user|>c<|end|><|assistant|>"
    )
    # a chat list under the prompt key works too
    assert encode_prompt(tok, {"q": chat}, prompt_key="q") == encode_prompt(tok, {"messages": chat})


def test_plain_text(tok):
    ids = encode_prompt(tok, {"prompt": "47+85"}, use_chat_template=False)
    assert tok.decode(ids) == "47+85"
    ids = encode_prompt(tok, {"prompt": "x"}, use_chat_template=False, system_prompt="S")
    assert tok.decode(ids) == "S\n\nx"
    no_template = build_tokenizer()
    no_template.chat_template = None
    assert tok.decode(encode_prompt(no_template, {"prompt": "47+85"})) == "47+85"


def test_errors(tok):
    with pytest.raises(ValueError, match="empty"):
        encode_prompt(tok, {"prompt": "   "})
    with pytest.raises(ValueError, match="empty"):
        encode_prompt(tok, {"messages": []})
    with pytest.raises(ValueError, match="no prompt"):
        encode_prompt(tok, {"question": "q", "_index": 5})
    with pytest.raises(ValueError, match="'role' and 'content'"):
        encode_prompt(tok, {"messages": [{"text": "hi"}]})
    with pytest.raises(PromptTooLong) as e:
        encode_prompt(tok, {"prompt": "x" * 20, "_index": 7}, max_prompt_tokens=10)
    assert isinstance(e.value, ValueError)
    assert e.value.num_tokens == 23 and e.value.max_tokens == 10 and "row 7" in str(e.value)
    assert len(encode_prompt(tok, {"prompt": "x" * 7}, max_prompt_tokens=10)) == 10
