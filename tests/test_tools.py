"""Tool calls through the official `openai` client, in the Hermes/Qwen format: a template that
renders ``tools`` itself and one that does not (lucepy writes them in), each with a forced call
(constrained decoding, so the test is deterministic), the tool's result, and the final answer;
streamed and not. Plus the parser and the rendering on their own."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from lucepy.engine import Engine
from lucepy.runtime.config import RuntimeConfig
from lucepy.server.chat import chat_text
from lucepy.server.run import Server
from lucepy.server.tools import CLOSE, GEMMA4, OPEN, ToolCallParser, tool_format
from lucepy.testing import vocab
from lucepy.testing.tiny import Qwen35Spec, write_qwen35

# A ChatML template that renders tools the way Qwen's do (written for these tests)
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools you may call:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n'
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SPEC = Qwen35Spec(n_layer=4, seed=5)


@pytest.fixture(scope="module", params=["native", "fallback"])
def served(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / f"{request.param}.gguf"
    saved = vocab.CHAT_TEMPLATE
    if request.param == "native":
        vocab.CHAT_TEMPLATE = TOOL_TEMPLATE
    try:
        write_qwen35(path, SPEC)
    finally:
        vocab.CHAT_TEMPLATE = saved
    engine = Engine(path, RuntimeConfig(threads=1, max_ctx=2048))
    srv = Server(engine, name="tiny", port=0, log_level="warning").start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    yield client, engine.tokenizer, request.param
    client.close()
    srv.stop()


def ask(client, messages, **kw):
    return client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=96, **kw
    )


def test_a_forced_call_its_result_and_the_final_answer(served):
    client, tokenizer, kind = served
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = ask(client, messages, tool_choice=named)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["city"], str) and len(args["city"]) <= 12
    assert call.id.startswith("call_")

    # streamed: the same call, in a tool_calls delta, and the same finish reason
    deltas, finish = [], None
    for chunk in ask(client, messages, tool_choice=named, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", call.function.arguments)
    ]

    # the tool's result goes back as a tool message; the model answers in text
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    final = ask(client, messages, tool_choice="none")
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")
    assert isinstance(final.choices[0].message.content, str)
    # and the prompt it answered held the call and the result
    rendered = chat_text(tokenizer, [_plain(m) for m in messages], None)
    assert '{"temperature": 21}' in rendered and "get_weather" in rendered

    # required: a call to one of the tools
    required = ask(client, messages[:1], tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls"
    assert required.message.tool_calls[0].function.name in ("get_weather", "get_time")


def _plain(m: dict) -> dict:
    """A message as the server hands it to the template (arguments as a mapping)."""
    if m.get("tool_calls"):
        calls = [
            {
                **c,
                "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in m["tool_calls"]
        ]
        return {**m, "content": "", "tool_calls": calls}
    return m


def test_tools_are_rendered_natively_or_written_in(served):
    _, tokenizer, kind = served
    messages = [{"role": "user", "content": "hi"}]
    text = chat_text(tokenizer, messages, [t for t in TOOLS])
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text
    assert ("Tools you may call" in text) == (kind == "native")
    assert (OPEN in text) and text.endswith("<|im_start|>assistant\n")
    assert chat_text(tokenizer, messages, None) == chat_text(tokenizer, messages)


def test_the_parser_cuts_calls_out_of_streamed_text():
    parser = ToolCallParser()
    body = '{"name": "f", "arguments": {"x": 1}}'
    text = f"Sure. {OPEN}\n{body}\n{CLOSE} and {OPEN}\nnot json\n{CLOSE} done <tool"
    pieces = [text[i : i + 2] for i in range(0, len(text), 2)]  # every tag split
    content, calls = "", []
    for piece in pieces:
        c, found = parser.feed(piece)
        content += c
        calls += found
    rest, _ = parser.flush()
    content += rest
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1})
    ]
    # a malformed call stays the model's text, and a held tail comes out at the end
    assert content == f"Sure.  and {OPEN}\nnot json\n{CLOSE} done <tool"


FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's shape


def test_responses_api_text_tools_and_streaming(served):
    client, _, _ = served
    text = client.responses.create(model="tiny", input="hello", max_output_tokens=8, temperature=0)
    assert text.status in ("completed", "incomplete") and text.output_text
    assert text.usage.output_tokens <= 8 and text.usage.input_tokens > 0
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
    )
    assert text.output_text == chat.choices[0].message.content

    # streamed: the same text, in output_text deltas, and a final response event
    deltas, final = [], None
    stream = client.responses.create(
        model="tiny", input="hello", max_output_tokens=8, temperature=0, stream=True
    )
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert "".join(deltas) == text.output_text and final.output_text == text.output_text

    # a forced function call, its output, and the answer
    named = {"type": "function", "name": "get_time"}
    called = client.responses.create(
        model="tiny", input="time?", tools=FLAT_TOOLS, tool_choice=named, temperature=0,
        max_output_tokens=96,
    )  # fmt: skip
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    events = [e.type for e in client.responses.create(
        model="tiny", input="time?", tools=FLAT_TOOLS, tool_choice=named, temperature=0,
        max_output_tokens=96, stream=True,
    )]  # fmt: skip
    assert "response.function_call_arguments.done" in events and events[-1] == "response.completed"
    answer = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "time?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"},
        ],
        tools=FLAT_TOOLS,
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id"


# --- the Gemma 4 format, on the converter-made gemma4 fixture and its Gemma 4 style template ---

GEMMA = Path(__file__).parent / "fixtures" / "hf" / "gemma4-q8_0.gguf"
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "The sum of two numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
UNIT = {
    "type": "function",
    "function": {
        "name": "convert",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "label": {"type": "string", "maxLength": 8},
            },
            "required": ["unit", "label"],
        },
    },
}


@pytest.fixture(scope="module")
def gemma():
    engine = Engine(GEMMA, RuntimeConfig(threads=1, max_ctx=1024))
    srv = Server(engine, name="gemma", port=0, log_level="warning").start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    yield client, engine.tokenizer
    client.close()
    srv.stop()


def test_a_gemma_call_its_result_and_the_final_answer(gemma):
    client, tokenizer = gemma
    assert tool_format(tokenizer.chat_template) is GEMMA4

    def ask_gemma(messages, **kw):
        return client.chat.completions.create(
            model="gemma", messages=messages, tools=[ADD, UNIT], temperature=0, max_tokens=160, **kw
        )

    messages = [{"role": "user", "content": "What is 2.5 plus 4.5?"}]
    named = {"type": "function", "function": {"name": "add"}}
    choice = ask_gemma(messages, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"}
    assert all(isinstance(v, int | float) for v in args.values())

    deltas, finish = [], None
    for chunk in ask_gemma(messages, tool_choice=named, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        ("add", call.function.arguments)
    ]

    # an enum and a bounded string, decoded in Gemma's syntax and parsed back to JSON
    other = {"type": "function", "function": {"name": "convert"}}
    (conv,) = ask_gemma(messages, tool_choice=other).choices[0].message.tool_calls
    conv_args = json.loads(conv.function.arguments)
    assert conv_args["unit"] in ("celsius", "fahrenheit") and len(conv_args["label"]) <= 8

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sum": 7}'},
    ]
    for stream in (False, True):
        reply = ask_gemma(messages, tool_choice="none", stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        else:
            assert reply.choices[0].message.tool_calls is None
            text = reply.choices[0].message.content
        assert isinstance(text, str)
    # the prompt of the final answer: the call in Gemma syntax, the result folded into the turn
    rendered = chat_text(tokenizer, [_plain(m) for m in messages], [ADD, UNIT])
    a, b = (json.dumps(args[k]) for k in ("a", "b"))  # numbers are written as JSON writes them
    assert f"<|turn>model\n<|tool_call>call:add{{a:{a},b:{b}}}<tool_call|>" in rendered
    assert "<|tool_response>response:add{sum:7}<tool_response|><turn|>" in rendered
    assert "<|tool>declaration:add{" in rendered and rendered.endswith("<|turn>model\n")

    required = ask_gemma(messages[:1], tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls"
    assert required.message.tool_calls[0].function.name in ("add", "convert")


def test_gemma_results_fold_into_the_turn_that_called():
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "mul", "arguments": '{"a": 2}'}},
    ]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "not json"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "again"},
    ]
    out = GEMMA4.render(messages, None, True)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    turn = out[1]
    assert turn["tool_responses"] == [
        {"name": "add", "response": 3},
        {"name": "mul", "response": "not json"},
    ]
    assert turn["content"] == "Done." and turn["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_the_gemma_parser_reads_its_value_syntax():
    body = 'call:f{s:<|"|>a, b<|"|>,n:-3,x:[1,2.5e1,true],d:{k:null},"q":false}'
    assert GEMMA4.parse(body) == (
        "f",
        {"s": "a, b", "n": -3, "x": [1, 25.0, True], "d": {"k": None}, '"q"': False},
    )
    for bad in ('call:f{a:<|"|>open}', "call:f{a:1", "f{a:1}", "call:f[1]", "call:f{a:1}x"):
        assert GEMMA4.parse(bad) is None, bad
    p = ToolCallParser(GEMMA4)
    got = [p.feed(t) for t in ("Sure <|tool", "_call>call:f{a:2.", "5}<tool_call|> ok")]
    assert [g[0] for g in got] == ["Sure ", "", " ok"]
    assert got[2][1][0]["function"] == {"name": "f", "arguments": '{"a": 2.5}'}
