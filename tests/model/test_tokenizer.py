"""The tokenizer rebuilt from GGUF metadata gives transformers' ids and decodes back; the chat
template renders as transformers renders it."""

from __future__ import annotations

import pytest

from kvserve.model.gguf_loader import apply_chat_template, bundled_model_path, load_gguf
from kvserve.model.tokenizer import ChatTemplateOptions

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " leading space",
    "trailing spaces   ",
    "multiple     spaces\tand\ttabs\n\nand\r\nnewlines\n\n\n",
    "digits 0123456789 3.14159 1,000,000 and 42nd",
    "x² + y³ = ½ ①②",
    "héllo wörld — naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🙂👍🏽🇫🇷 and zero\u200bwidth",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><repo_name>",
    "don't won't I'll we've they're it's",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "CamelCaseWords and snake_case_words and UPPER-CASE!!!???",
    "https://example.com/path?q=1&r=two#frag",
]


@pytest.fixture(scope="module")
def loaded():
    return load_gguf(bundled_model_path())


def test_ids_equal_transformers(hf_tokenizer, loaded):
    for text in TEXTS:
        assert loaded.encode(text) == hf_tokenizer(text)["input_ids"], text


def test_decode_round_trips(loaded):
    for text in TEXTS:
        assert loaded.decode(loaded.encode(text), skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_and_skippable(loaded):
    ids = loaded.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert loaded.decode(ids) == "user\nhi"


def test_chat_template_equals_transformers(hf_tokenizer, loaded):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
    for add in (True, False):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert loaded.render_chat(messages, ChatTemplateOptions(add_generation_prompt=add)) == expected
        assert apply_chat_template(loaded.chat_template, messages, add) == expected
    with_system = [{"role": "system", "content": "Be brief."}, messages[0]]
    assert loaded.render_chat(with_system) == hf_tokenizer.apply_chat_template(
        with_system, tokenize=False, add_generation_prompt=True
    )


def test_continue_final_message_and_template_kwargs_equal_transformers(hf_tokenizer, loaded):
    """The last message left open (assistant prefill; its text with and without a trailing space, which the
    template keeps) and extra template variables, as transformers' apply_chat_template renders them."""
    continued = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    for prefill in ("The capital is", "The capital is "):
        messages = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": prefill}]
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                    continue_final_message=True)
        assert loaded.render_chat(messages, continued) == expected
        assert expected.endswith(prefill)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    options = ChatTemplateOptions(template_kwargs={"shout": True})
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template, shout=True)
    assert loaded.render_chat(messages, options, template=template) == expected == messages[0]["content"] + prefill + "!"
    with pytest.raises(ValueError, match="add_generation_prompt false"):
        ChatTemplateOptions(continue_final_message=True)
    with pytest.raises(ValueError, match="'messages'"):
        ChatTemplateOptions(template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="does not copy"):  # (a template that leaves the text out)
        loaded.render_chat(messages, continued, template="{% for m in messages %}{{ m['role'] }}{% endfor %}")
