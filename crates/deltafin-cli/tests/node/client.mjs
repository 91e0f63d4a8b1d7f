// The official openai Node client against `deltafin serve` replaying a recorded K3 reply that
// calls a tool (run by tests/server_conformance.rs): models, chat, streaming, completions, tool
// calls, errors.
import OpenAI from "openai";
import assert from "node:assert/strict";

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "unused" });
const list = await client.models.list();
const id = list.data[0].id;
const model = await client.models.retrieve(id);
assert.equal(model.id, id);

const tools = [{ type: "function", function: { name: "get_weather", parameters: { type: "object", properties: { city: { type: "string" } } } } }];
const messages = [{ role: "user", content: "What is the weather in Paris?" }];
const r = await client.chat.completions.create({ model: id, messages, tools });
assert.equal(r.choices[0].finish_reason, "tool_calls");
const call = r.choices[0].message.tool_calls[0];
assert.equal(call.function.name, "get_weather");
assert.deepEqual(JSON.parse(call.function.arguments), { city: "Paris" });

const stream = await client.chat.completions.create({ model: id, messages, tools, stream: true, stream_options: { include_usage: true } });
let args = "", finish = null, usage = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) {
    finish = c.finish_reason ?? finish;
    for (const t of c.delta.tool_calls ?? []) args += t.function?.arguments ?? "";
  }
}
assert.equal(finish, "tool_calls");
assert.equal(args, call.function.arguments);
assert.ok(usage.completion_tokens > 0);

messages.push(r.choices[0].message, { role: "tool", tool_call_id: call.id, content: "18C" });
const r2 = await client.chat.completions.create({ model: id, messages, tools });
assert.ok(r2.usage.prompt_tokens > r.usage.prompt_tokens);

const c = await client.completions.create({ model: id, prompt: "Numbers matter", max_tokens: 3 });
assert.equal(typeof c.choices[0].text, "string");

await assert.rejects(client.chat.completions.create({ model: id, messages, n: 2 }), (e) => e.status === 400 && e.param === "n");
await assert.rejects(client.models.retrieve("gpt-4"), (e) => e.status === 404);
console.log("ok");
