"""Chat template rendering, ``--chat-template-kwargs`` parsing and BOS handling of chat prompts."""

from __future__ import annotations

import pytest

from tsspec.chat import build_messages, encode_chat, parse_template_kwargs, render_chat
from tsspec.errors import BadInput
from tsspec.tokenizer import Tokenizer

TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}\n"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
)


def test_inline_template_with_system_prompt():
    text = render_chat(TEMPLATE, build_messages("hi", system="be brief"), bos_token="<s>", eos_token="</s>")
    # trim_blocks/lstrip_blocks: the newlines after block tags are not part of the output.
    assert text == "<s><|system|>be brief</s>\n<|user|>hi</s>\n<|assistant|>"


def test_generation_prompt_optional():
    text = render_chat(TEMPLATE, build_messages("hi"), add_generation_prompt=False)
    assert text == "<|user|>hi\n"


def test_template_kwargs_reach_the_template():
    kwargs = parse_template_kwargs('{"enable_thinking": false}')
    assert kwargs == {"enable_thinking": False}
    assert render_chat(TEMPLATE, build_messages("hi"), **kwargs).endswith("<|assistant|><think></think>")
    assert not render_chat(TEMPLATE, build_messages("hi")).endswith("</think>")


def test_build_messages():
    assert build_messages("q") == [{"role": "user", "content": "q"}]
    assert build_messages("q", "s") == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]


def test_helpers_hf_templates_use():
    template = "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
    out = render_chat(template, [{"role": "user", "content": "<a&b>"}])
    # tojson must not HTML-escape, unlike jinja's built-in filter.
    assert out == '[{"role": "user", "content": "<a&b>"}]|4'


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", '"text"', ""])
def test_bad_template_kwargs(bad):
    with pytest.raises(BadInput, match=r"^--chat-template-kwargs: "):
        parse_template_kwargs(bad)


def test_template_errors_are_bad_input():
    with pytest.raises(BadInput, match="rejected the conversation: roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", build_messages("hi"))
    with pytest.raises(BadInput, match="does not parse"):
        render_chat("{% for m in messages %}", build_messages("hi"))
    with pytest.raises(BadInput, match="failed to render"):
        render_chat("{{ messages[5]['content'] | upper }}", build_messages("hi"))


def test_sandbox_blocks_unsafe_access():
    with pytest.raises(BadInput):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [])


def _bos_tokenizer() -> Tokenizer:
    from tsspec.tokenizer import _byte_level_alphabet

    alphabet = [_byte_level_alphabet()[0][b] for b in range(256)]
    tokens = alphabet + ["<s>", "<|user|>"]
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3, 3],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.add_bos_token": True,
    })


def test_encode_chat_adds_exactly_one_bos():
    tok = _bos_tokenizer()
    with_bos = encode_chat(tok, "<s><|user|>hi")
    without = encode_chat(tok, "<|user|>hi")
    assert with_bos == without
    assert with_bos[:2] == [256, 257] and with_bos.count(256) == 1


# -- real templates ----------------------------------------------------------------------------


@pytest.mark.real_model
def test_smollm2_template(real_model_path):
    tok = Tokenizer.from_gguf(real_model_path("smollm2-135m"))
    text = render_chat(tok.chat_template, build_messages("What is 2+2?"),
                       bos_token=tok.token_text(tok.bos_id), eos_token=tok.token_text(tok.eos_id))
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    custom = render_chat(tok.chat_template, build_messages("hi", system="Be terse."))
    assert custom.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi")
    ids = encode_chat(tok, text)
    assert ids[0] == tok.encode("<|im_start|>", add_special=False)[0]  # no BOS: add_bos is false
    assert tok.decode(ids) == text


@pytest.mark.real_model
def test_qwen_template_and_kwargs(real_model_path):
    tok = Tokenizer.from_gguf(real_model_path("qwen2.5-coder-0.5b"))
    plain = render_chat(tok.chat_template, build_messages("hi"))
    assert plain == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = render_chat(tok.chat_template, build_messages("hi", "Answer in code."),
                              **parse_template_kwargs('{"enable_thinking": false}'))
    assert with_system.startswith("<|im_start|>system\nAnswer in code.<|im_end|>\n<|im_start|>user\nhi")
    ids = encode_chat(tok, with_system)
    im_start = tok.encode("<|im_start|>")[0]
    assert ids.count(im_start) == 3 and tok.decode(ids) == with_system


@pytest.mark.real_model
def test_gemma_no_double_bos(real_model_path):
    tok = Tokenizer.from_gguf(real_model_path("gemma3-270m"))
    assert tok.add_bos
    text = "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    with_bos = encode_chat(tok, "<bos>" + text)
    assert with_bos == encode_chat(tok, text)
    assert with_bos[0] == tok.bos_id and with_bos.count(tok.bos_id) == 1
