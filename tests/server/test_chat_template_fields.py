"""vLLM's chat-template fields: `continue_final_message` (assistant prefill) through the real openai client,
rendered as /tokenize renders it and answered as the engine answers those ids; `chat_template_kwargs` reaching
the template (Qwen3's enable_thinking switch, on LLM.chat as on the server); what cannot work is a 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvserve import SamplingParams
from tests.conftest import make_llm
from tests.server.conftest import SMALL_ENGINE

PREFILL = [{"role": "user", "content": "Name a day of the week."},
           {"role": "assistant", "content": "My favourite day of the week is"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
# Qwen3's switch, cut down: thinking is skipped by an empty think block after the generation prompt
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                     "{% endif %}{% endif %}")


def tokenize(server, **body) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_continue_final_message_answers_on_from_the_prefill(server, client, model_name):
    llm = make_llm(**SMALL_ENGINE)  # (the server's mode)
    ids = tokenize(server, messages=PREFILL, **CONTINUE)
    text = llm.get_tokenizer().decode(ids, skip_special_tokens=False)
    assert text.endswith(PREFILL[-1]["content"])  # the assistant turn left open
    assert ids == llm.get_tokenizer().encode(llm.engine.chat_prompt(PREFILL[:1]) + PREFILL[-1]["content"]).ids
    continued = client.chat.completions.create(model=model_name, messages=PREFILL, max_tokens=8, temperature=0,
                                               extra_body=CONTINUE)
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=8))[0].outputs[0].text
    new_turn = client.chat.completions.create(model=model_name, messages=PREFILL, max_tokens=8, temperature=0)
    assert continued.choices[0].message.content == want != new_turn.choices[0].message.content
    assert continued.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("extra, says", [
    ({"continue_final_message": True}, "add_generation_prompt false"),
    ({"chat_template_kwargs": {"messages": []}}, "'messages'"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
])
def test_what_cannot_be_rendered_is_a_400(client, model_name, extra, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=PREFILL, max_tokens=1, extra_body=extra)
    assert says in str(err.value.body), err.value.body


def test_continuing_a_message_without_text_is_a_400(server, client, model_name):
    empty = [PREFILL[0], {"role": "assistant", "content": ""}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=empty, max_tokens=1, extra_body=CONTINUE)
    assert "continue" in err.value.body["message"]
    response = httpx.post(server.url + "/tokenize", json={"messages": empty, **CONTINUE}, timeout=60)
    assert response.status_code == 400 and "continue" in response.text


def test_chat_template_kwargs_reach_the_template():
    llm = make_llm(kv_cache_memory="64MiB", max_model_len=512, chat_template=THINKING_TEMPLATE)
    ask = PREFILL[:1]
    thinking = llm.chat(ask, SamplingParams(max_tokens=1))[0].prompt
    direct = llm.chat(ask, SamplingParams(max_tokens=1), chat_template_kwargs={"enable_thinking": False})[0].prompt
    assert thinking.endswith("<|im_start|>assistant\n") and direct == thinking + "<think>\n\n</think>\n\n"
    continued = llm.chat(PREFILL, SamplingParams(max_tokens=1), add_generation_prompt=False,
                         continue_final_message=True)[0].prompt
    assert continued.endswith("\n" + PREFILL[-1]["content"])
