"""The official openai client against `deltafin serve` (run by tests/server.rs)."""
import json
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused")

models = client.models.list()
assert len(models.data) == 1, models

r = client.chat.completions.create(model=models.data[0].id, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
assert r.choices[0].finish_reason == "length", r
assert r.usage.completion_tokens == 5, r.usage
text = (getattr(r.choices[0].message, "reasoning_content", None) or "") + (r.choices[0].message.content or "")
assert len(text) > 0, r

stream = client.chat.completions.create(model="k3", messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True, stream_options={"include_usage": True})
pieces, usage = [], None
for chunk in stream:
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        d = c.delta
        pieces.append((getattr(d, "reasoning_content", None) or "") + (d.content or ""))
assert "".join(pieces) == text, ("".join(pieces), text)
assert usage.completion_tokens == 5

c = client.completions.create(model="k3", prompt="Numbers matter here too: 12 boats and 42 answers.", max_tokens=3, logprobs=2)
assert c.choices[0].text == " exper\ufffdre", c
assert len(c.choices[0].logprobs.tokens) == 3

lp = client.chat.completions.create(model="k3", messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=2)
assert len(lp.choices[0].logprobs.content) == 2

for bad in [dict(n=2), dict(frequency_penalty=0.5), dict(logit_bias={"1": 1})]:
    try:
        client.chat.completions.create(model="k3", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **bad)
        raise SystemExit(f"{bad} was accepted")
    except openai.BadRequestError as e:
        assert list(bad)[0] in str(e), e
# Structured output: the reply is JSON the schema accepts, whatever the (random) weights prefer.
schema = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
          "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 7}, "maxItems": 3}},
          "required": ["unit", "days"], "additionalProperties": False}
r = client.chat.completions.create(model="k3", messages=[{"role": "user", "content": "weather?"}], max_tokens=100,
                                   response_format={"type": "json_schema", "json_schema": {"name": "weather", "strict": True, "schema": schema}})
v = json.loads(r.choices[0].message.content)
assert set(v) == {"unit", "days"} and v["unit"] in ("celsius", "fahrenheit"), v
assert len(v["days"]) <= 3 and all(isinstance(d, int) and 1 <= d <= 7 for d in v["days"]), v
print("openai client: ok")
