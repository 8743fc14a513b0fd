"""The OpenAI `POST /v1/chat/completions` request and response shapes.

`parse_chat_request(raw, template)` checks the `messages` (role system, user or assistant;
content a string or a list of text parts), renders them with the model's chat template
(model_files.chat_template, ending with the assistant's turn header) and hands the rendered prompt
plus every other field to the completions parser, so both routes share one set of sampling
fields and bounds; the result is a `CompletionRequest` (id "chatcmpl-...") whose prompt is
encoded without extra special tokens, since the template writes them. Chat-only fields
(`max_completion_tokens`, `logprobs` + `top_logprobs`; `tools`, `response_format`... only at
their no-op values) are handled here. A model without a chat template gets InvalidRequest (400) saying so.
`CHAT` is the response format: `chat.completion` with `message`, `chat.completion.chunk` with
`delta` (the first chunk of each choice carries the role). Nothing here imports torch.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from coordinator.completion import ResponseFormat
from coordinator.completion_request import (
    CompletionRequest,
    InvalidRequest,
    json_object,
    parse_completion_request,
)
from coordinator.fields import bool_field, int_field
from coordinator.logprobs import chat_logprobs
from model_files.chat_template import ChatTemplateError
from protocol.sampling import MAX_LOGPROBS, MAX_N

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = {"role", "content", "name"}
# Chat-only fields accepted only at a value that changes nothing.
_CHAT_NOOP = {"tools": (None, []),
              "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
              "functions": (None, []), "function_call": (None, "none", "auto"),
              "response_format": (None, {"type": "text"})}


def _content(index: int, content) -> str:
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            is_text = isinstance(part, dict) and part.get("type") == "text"
            if not is_text or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"'{where}' parts must be {{\"type\": \"text\", \"text\": str}}; "
                                     "other content (images, audio) is not supported", param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequest(f"'{where}' must be a string or a non-empty list of text parts", param="messages")


def parse_messages(messages) -> list[dict]:
    """The messages as the template sees them: {"role", "content"(, "name")} with text content."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of {\"role\", \"content\"} objects",
                             param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object", param="messages")
        extra = sorted(set(message) - MESSAGE_KEYS)
        if extra:
            raise InvalidRequest(f"'messages[{i}]' has unsupported field(s): {', '.join(extra)}",
                                 param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r}",
                                 param="messages")
        if "content" not in message:
            raise InvalidRequest(f"'messages[{i}].content' is required", param="messages")
        item = {"role": role, "content": _content(i, message["content"])}
        if "name" in message:
            if not isinstance(message["name"], str):
                raise InvalidRequest(f"'messages[{i}].name' must be a string", param="messages")
            item["name"] = message["name"]
        out.append(item)
    return out


def parse_chat_request(raw: bytes | str | dict, template, *, max_n: int = MAX_N,
                       request_id: str | None = None) -> CompletionRequest:
    """Validate a chat body and render its prompt with `template` (a model_files.chat_template
    ChatTemplate, or None when the model has none); raises InvalidRequest naming the field."""
    body = json_object(raw)
    if "prompt" in body:
        raise InvalidRequest("chat completions take 'messages', not 'prompt' (that is /v1/completions)",
                             param="prompt")
    refused = sorted(k for k, ok in _CHAT_NOOP.items() if k in body and body[k] not in ok)
    if refused:
        raise InvalidRequest(f"unsupported field(s): {', '.join(refused)}", param=refused[0])
    messages = parse_messages(body.get("messages"))
    logprobs = _logprobs(body)
    chat_only = {*_CHAT_NOOP, "messages", "max_completion_tokens", "logprobs", "top_logprobs"}
    rest = {k: v for k, v in body.items() if k not in chat_only}
    limit = body.get("max_completion_tokens")
    if limit is not None:
        if rest.get("max_tokens") not in (None, limit):
            raise InvalidRequest("'max_tokens' and 'max_completion_tokens' disagree; send one",
                                 param="max_completion_tokens")
        rest["max_tokens"] = limit
    if template is None:
        raise InvalidRequest("this model has no chat template, so it cannot take chat messages; "
                             "send a plain prompt to /v1/completions", param="messages",
                             code="chat_template_missing")
    try:
        prompt = template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise InvalidRequest(f"the chat template refused the messages: {e}", param="messages") from None
    creq = parse_completion_request({**rest, "prompt": prompt}, max_n=max_n,
                                    request_id=request_id or f"chatcmpl-{uuid.uuid4().hex}")
    return replace(creq, add_special_tokens=False, logprobs=logprobs)


def _logprobs(body: dict) -> int | None:
    """Chat's `logprobs: true` (+ `top_logprobs: N`) as the number of top alternatives per token."""
    wanted = bool_field(body, "logprobs")
    top = int_field(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _choice(index: int, text: str, token_ids: list[int], finish_reason: str | None,
            logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "token_ids": token_ids,
            "finish_reason": finish_reason, "logprobs": logprobs}


def _chunk_choice(index: int, text: str, token_ids: list[int], finish_reason: str | None,
                  first: bool, logprobs: dict | None = None) -> dict:
    # NOTE: "content" always present (maybe ""): some clients index delta["content"] unconditionally
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta": delta, "token_ids": token_ids, "logprobs": logprobs,
            "finish_reason": finish_reason}


CHAT = ResponseFormat(object="chat.completion", chunk_object="chat.completion.chunk",
                      choice=_choice, chunk_choice=_chunk_choice, logprobs=chat_logprobs)
