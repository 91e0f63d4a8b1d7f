"""The official openai client's tool calls against `deltafin serve` replaying a recorded K3 reply
that calls a tool (run by tests/server_conformance.rs): parsed whole and streamed, and an
agent-style loop that sends the call and its result back."""
import json
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused")
model = client.models.retrieve(client.models.list().data[0].id)
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]

r = client.chat.completions.create(model=model.id, messages=messages, tools=tools)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", r
call = choice.message.tool_calls[0]
assert call.type == "function" and call.function.name == "get_weather", call
assert json.loads(call.function.arguments) == {"city": "Paris"}, call

stream = client.chat.completions.create(model=model.id, messages=messages, tools=tools, stream=True)
calls, finish = {}, None
for chunk in stream:
    for c in chunk.choices:
        finish = c.finish_reason or finish
        for d in c.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = d.id or entry["id"]
            if d.function and d.function.name:
                entry["name"] = d.function.name
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
assert finish == "tool_calls", finish
assert calls[0] == {"id": call.id, "name": "get_weather", "arguments": call.function.arguments}, calls

# An agent's next turn: the assistant's call and the tool's result go back.
messages.append(choice.message.model_dump(exclude_none=True))
messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})})
r2 = client.chat.completions.create(model=model.id, messages=messages, tools=tools, tool_choice="auto")
assert r2.usage.prompt_tokens > r.usage.prompt_tokens, (r2.usage, r.usage)

for choice_arg in ["required", {"type": "function", "function": {"name": "get_weather"}}, "none"]:
    client.chat.completions.create(model=model.id, messages=messages, tools=tools, tool_choice=choice_arg)

try:
    client.chat.completions.create(model=model.id, messages=messages, tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}})
    raise AssertionError("an undeclared tool must be refused")
except openai.BadRequestError as e:
    assert "nope" in str(e), e
print("ok")
