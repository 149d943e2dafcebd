"""A scripted agent loop against the default model: two tools, the calls it makes executed and
sent back, until it answers in text (at most 4 rounds). The first round's `tool_choice` is
`--tool-choice` (auto by default; `required` forces a call), later rounds' auto.

    python tools/agent_loop.py [--model NAME_OR_PATH] [--question TEXT] [--tool-choice C]

Starts `lucepy serve` in this process on a free port and talks to it with the official openai
client, as an agent framework would. Prints each round.
"""

from __future__ import annotations

import argparse
import json

import openai

from lucepy import catalog
from lucepy.engine import open_engine
from lucepy.runtime.config import RuntimeConfig
from lucepy.server.run import Server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
]


def run_tool(name: str, args: dict) -> str:
    if name == "get_weather":
        return json.dumps({"city": args.get("city"), "temperature_c": 18, "sky": "cloudy"})
    if name == "add":
        return json.dumps({"sum": float(args.get("a", 0)) + float(args.get("b", 0))})
    return json.dumps({"error": f"no tool {name}"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--question", default="What is the weather in Paris right now?")
    ap.add_argument("--tool-choice", default="auto", help="auto, required or none (round 0)")
    args = ap.parse_args()
    found = catalog.resolve(args.model, catalog.load_catalog())
    engine = open_engine(found.path, RuntimeConfig(threads=2, max_ctx=4096))
    name = found.name
    srv = Server(engine, name=name, port=0, log_level="warning").start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": args.question}]
        for round_ in range(4):
            choice = args.tool_choice if round_ == 0 else "auto"
            reply = client.chat.completions.create(
                model=name,
                messages=messages,
                tools=TOOLS,
                tool_choice=choice,
                temperature=0,
                max_tokens=128,
            )
            msg = reply.choices[0].message
            print(f"round {round_}: finish={reply.choices[0].finish_reason}")
            if not msg.tool_calls:
                print(f"  answer: {msg.content!r}")
                return
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls:
                result = run_tool(call.function.name, json.loads(call.function.arguments))
                print(f"  call {call.function.name}({call.function.arguments}) -> {result}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        print("  no text answer after 4 rounds")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
