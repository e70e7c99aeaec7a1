"""vLLM's chat-template fields, on /v1/chat/completions and /tokenize: `add_generation_prompt`,
`continue_final_message` (the answer continues the last message: assistant prefill) and `chat_template_kwargs`
(extra template variables, such as Qwen3's `enable_thinking`), checked here and rendered as
tokenizer.ChatTemplateOptions."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, StrictBool, model_validator

from kvserve.model.tokenizer import ChatTemplateOptions

MAX_TEMPLATE_KWARGS = 64


class ChatTemplateFields(BaseModel):
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None

    @model_validator(mode="after")
    def _options_build(self) -> ChatTemplateFields:
        self.template_options()  # (raises what is wrong: a 400)
        return self

    def template_options(self) -> ChatTemplateOptions:
        return ChatTemplateOptions(self.add_generation_prompt, self.continue_final_message,
                                   dict(self.chat_template_kwargs or {}))
