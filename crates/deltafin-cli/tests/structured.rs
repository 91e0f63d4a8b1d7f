//! Structured output over `deltafin serve` (issue 51.2): `response_format` with `json_object` and
//! `json_schema` gives JSON the schema accepts, whole or streamed, greedy or sampled, alone or in
//! a lockstep batch (where each reply equals its solo run); a schema that cannot be compiled is a
//! 400 naming `response_format`. The fixture's weights are random: whatever it prefers, the
//! grammar must hold.

use serde_json::{json, Value};

mod common;

use common::server::*;

/// Checks `v` against the parts of JSON Schema these tests use; the error names the path.
fn validate(schema: &Value, v: &Value, path: &str) -> Result<(), String> {
    let fail = |why: &str| Err(format!("{path}: {why} ({v})"));
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        if !options.contains(v) {
            return fail("not one of the enum");
        }
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => {
            let Some(o) = v.as_object() else { return fail("not an object") };
            let props = schema.get("properties").and_then(Value::as_object).cloned().unwrap_or_default();
            for r in schema.get("required").and_then(Value::as_array).into_iter().flatten() {
                if !o.contains_key(r.as_str().unwrap()) {
                    return fail(&format!("lacks required {r}"));
                }
            }
            for (k, val) in o {
                match props.get(k) {
                    Some(s) => validate(s, val, &format!("{path}.{k}"))?,
                    None if schema.get("additionalProperties") == Some(&json!(false)) => return fail(&format!("extra key {k}")),
                    None => {}
                }
            }
        }
        Some("array") => {
            let Some(a) = v.as_array() else { return fail("not an array") };
            if schema.get("maxItems").and_then(Value::as_u64).is_some_and(|m| a.len() as u64 > m) {
                return fail("too many items");
            }
            if let Some(items) = schema.get("items") {
                for (i, x) in a.iter().enumerate() {
                    validate(items, x, &format!("{path}[{i}]"))?;
                }
            }
        }
        Some("string") => {
            let Some(s) = v.as_str() else { return fail("not a string") };
            if schema.get("maxLength").and_then(Value::as_u64).is_some_and(|m| s.chars().count() as u64 > m) {
                return fail("too long");
            }
        }
        Some("integer") => {
            let Some(n) = v.as_i64() else { return fail("not an integer") };
            if schema.get("minimum").and_then(Value::as_i64).is_some_and(|m| n < m)
                || schema.get("maximum").and_then(Value::as_i64).is_some_and(|m| n > m)
            {
                return fail("out of range");
            }
        }
        Some("boolean") if !v.is_boolean() => return fail("not a boolean"),
        _ => {}
    }
    Ok(())
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 31}, "maxItems": 4},
            "at": {"type": "object", "properties": {"north": {"type": "boolean"}, "zone": {"enum": ["utc", "local"]}},
                   "required": ["north", "zone"], "additionalProperties": false}
        }, "required": ["city", "unit", "days", "at"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "steps": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                      "done": {"type": "boolean"}}, "required": ["n", "done"], "additionalProperties": false}, "maxItems": 3}
        }, "required": ["steps"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"], "additionalProperties": false}),
    ]
}

fn body(text: &str, schema: &Value, stream: bool) -> Value {
    let mut b = chat_body(text, 200);
    b["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "reply", "strict": true, "schema": schema}});
    b["stream"] = json!(stream);
    b
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("no content: {v}")).to_string()
}

#[test]
fn replies_follow_their_schemas_whole_streamed_sampled_and_batched() {
    let s = start(&[]);
    let mut solo = vec![];
    for (i, schema) in schemas().iter().enumerate() {
        for prompt in ["What is the weather?", "List the steps.", "Say something long and winding about boats"] {
            let (st, v) = s.json("/v1/chat/completions", &body(prompt, schema, false));
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "stop", "the reply ended by itself: {v}");
            let text = content(&v);
            let parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("schema {i}: {text:?} is not JSON: {e}"));
            validate(schema, &parsed, "$").unwrap_or_else(|e| panic!("schema {i}: {e}"));
            // Streamed: the same text in its deltas.
            let (st, _, streamed) = s.post("/v1/chat/completions", &body(prompt, schema, true));
            assert_eq!(st, 200);
            let deltas: String = sse_data(&streamed)
                .iter()
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
                .collect();
            assert_eq!(deltas, text, "schema {i}: streamed text");
            solo.push((prompt, schema.clone(), text));
        }
    }
    // Sampled: still valid, and the same seed gives the same reply.
    let schema = &schemas()[0];
    let mut b = body("Weather, please", schema, false);
    b["temperature"] = json!(1.3);
    b["seed"] = json!(7);
    let (_, a) = s.json("/v1/chat/completions", &b);
    let (_, again) = s.json("/v1/chat/completions", &b);
    assert_eq!(content(&a), content(&again));
    validate(schema, &serde_json::from_str(&content(&a)).unwrap(), "$").unwrap();
    // Any object.
    let mut b = chat_body("hi", 200);
    b["response_format"] = json!({"type": "json_object"});
    let (st, v) = s.json("/v1/chat/completions", &b);
    assert_eq!(st, 200);
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(&content(&v)).unwrap().is_object(), "{v}");
    }
    // A schema llguidance cannot compile: a 400 that names the field and the part.
    let bad = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}});
    let (st, v) = s.json("/v1/chat/completions", &body("hi", &bad, false));
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "response_format");
    assert!(v["error"]["message"].as_str().unwrap().contains("missing"), "{v}");
    drop(s);

    // In a lockstep batch: every reply is its solo reply.
    let s = start(&["--max-batch", "4"]);
    let got: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            solo.iter().map(|(p, schema, _)| scope.spawn(|| content(&s.json("/v1/chat/completions", &body(p, schema, false)).1))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((_, _, want), got) in solo.iter().zip(&got) {
        assert_eq!(got, want, "batched reply differs from solo");
    }
}
