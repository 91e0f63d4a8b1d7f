//! Grammars over the committed trained model's tokenizer, driven by random logits: whatever the
//! model prefers, the reply is JSON that the schema accepts, then K3's closing ids.

use super::*;

fn tokenizer() -> Arc<Tokenizer> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../training/models/k3");
    let ranks = std::fs::read_to_string(dir.join("tiktoken.model")).unwrap();
    let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    Arc::new(Tokenizer::from_tiktoken(&ranks, Some(&cfg), deltafin_core::K3_PATTERN).unwrap())
}

/// Generates with `c` from xorshift logits (greedy among the allowed) until `<|end_of_msg|>`;
/// returns the text before `<|close|>` and every id.
fn generate(tok: &Tokenizer, c: &Constraint, seed: u64, steps: usize) -> (String, Vec<u32>) {
    let mut x = seed | 1;
    let mut ids = vec![];
    let end = tok.special("<|end_of_msg|>").unwrap();
    let opts = deltafin_sched::GenerateOptions::new(steps);
    for p in 0..steps {
        let logits: Vec<f32> = (0..tok.vocab_len() + 7)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 1000) as f32 / 100.0
            })
            .collect();
        let id = opts.clone().constraint(Some(c.clone())).next_token(&logits, p).unwrap();
        ids.push(id);
        if id == end {
            break;
        }
    }
    let close = tok.special("<|close|>").unwrap();
    let json_ids: Vec<u32> = ids.iter().copied().take_while(|&i| i != close).collect();
    (tok.decode(&json_ids), ids)
}

#[test]
fn any_object_then_the_closing_ids() {
    let tok = tokenizer();
    let g = Grammars::new(tok.clone()).unwrap();
    for seed in 1..6 {
        let (text, ids) = generate(&tok, &g.json(None).unwrap(), seed, 400);
        if ids.last() != tok.special("<|end_of_msg|>").as_ref() {
            continue; // a random walk may still be inside a long string; the schemas below bound it
        }
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v.is_object(), "{text}");
        let close = tok.special("<|close|>").unwrap();
        let tail = &ids[ids.iter().position(|&i| i == close).unwrap()..];
        assert_eq!(tok.decode(tail).replace(['\u{0}'], ""), "", "specials decode to nothing");
        assert_eq!(tail.iter().filter(|&&i| i == close).count(), 2, "the response and the message are closed");
    }
}

#[test]
fn schemas_with_nesting_enums_and_arrays_are_followed() {
    let tok = tokenizer();
    let g = Grammars::new(tok.clone()).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
            "where": {"type": "object", "properties": {"lat": {"type": "boolean"}}, "required": ["lat"], "additionalProperties": false}
        },
        "required": ["city", "unit", "days", "where"],
        "additionalProperties": false
    });
    for seed in 1..9 {
        let (text, ids) = generate(&tok, &g.json(Some(&schema)).unwrap(), seed, 300);
        assert_eq!(ids.last(), tok.special("<|end_of_msg|>").as_ref(), "the reply ends: {text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{text}");
        assert!(["celsius", "fahrenheit"].contains(&v["unit"].as_str().unwrap()), "{text}");
        let days = v["days"].as_array().unwrap();
        assert!(days.len() <= 3 && days.iter().all(|d| d.as_i64().is_some_and(|d| (0..=9).contains(&d))), "{text}");
        assert!(v["where"]["lat"].is_boolean(), "{text}");
        assert_eq!(v.as_object().unwrap().len(), 4, "no other keys: {text}");
    }
}

#[test]
fn a_schema_it_cannot_compile_is_an_error_naming_it() {
    let g = Grammars::new(tokenizer()).unwrap();
    let e = g.json(Some(&serde_json::json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))).unwrap_err();
    assert!(e.to_string().contains("nowhere"), "{e}");
    assert!(g.json(Some(&serde_json::json!("x"))).is_err());
}

#[test]
fn a_required_call_names_a_declared_tool_and_its_arguments_fit_its_schema() {
    let tok = tokenizer();
    let g = Grammars::new(tok.clone()).unwrap();
    let weather = serde_json::json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": false});
    let add = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"], "additionalProperties": false});
    let tools = [Tool { name: "get_weather", parameters: Some(&weather) }, Tool { name: "add", parameters: Some(&add) }];
    let (open, close, sep) = (tok.special("<|open|>").unwrap(), tok.special("<|close|>").unwrap(), tok.special("<|sep|>").unwrap());
    let mut seen = std::collections::HashSet::new();
    for seed in 1..12 {
        let (head, ids) = generate(&tok, &g.tool_call(&tools, None).unwrap(), seed, 300);
        assert_eq!(ids.last(), tok.special("<|end_of_msg|>").as_ref(), "{head:?}");
        let name = deltafin_core::attr_of(&format!("tool_call{head}"), "name").unwrap_or_else(|| panic!("{head:?}"));
        let at = ids.iter().position(|&i| i == sep).unwrap();
        let args_end = ids.iter().position(|&i| i == close).unwrap();
        let args: Value = serde_json::from_str(&tok.decode(&ids[at + 1..args_end])).unwrap();
        match name.as_str() {
            "get_weather" => {
                assert!(args["city"].as_str().unwrap().chars().count() <= 10 && ["c", "f"].contains(&args["unit"].as_str().unwrap()))
            }
            "add" => assert!((0..=9).contains(&args["a"].as_i64().unwrap()) && (0..=9).contains(&args["b"].as_i64().unwrap())),
            other => panic!("undeclared tool {other}"),
        }
        assert!(!ids.contains(&open), "no other element opens");
        seen.insert(name);
    }
    assert_eq!(seen.len(), 2, "random preferences reach both tools");
    // Named: only that tool's arguments.
    let (text, ids) = generate(&tok, &g.tool_call(&tools, Some("add")).unwrap(), 5, 300);
    assert_eq!(ids[0], sep, "the prompt holds the name: {text:?}");
    let args_end = ids.iter().position(|&i| i == close).unwrap();
    let args: Value = serde_json::from_str(&tok.decode(&ids[1..args_end])).unwrap();
    assert!(args["a"].is_i64() && args["b"].is_i64(), "{args}");
    assert!(g.tool_call(&tools, Some("nope")).is_err());
}

#[test]
fn a_free_turn_with_tools_keeps_its_text_and_constrains_every_call() {
    let tok = tokenizer();
    let g = Grammars::new(tok.clone()).unwrap();
    let add = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"], "additionalProperties": false});
    let tools = [Tool { name: "add", parameters: Some(&add) }];
    let (open, close, sep, end) = (
        tok.special("<|open|>").unwrap(),
        tok.special("<|close|>").unwrap(),
        tok.special("<|sep|>").unwrap(),
        tok.special("<|end_of_msg|>").unwrap(),
    );
    let c = g.tool_turn(&tools).unwrap();
    // Text the grammar must let through as the model writes it: reasoning, a reply, one call.
    let mut script = tok.encode_ordinary("Let me think.\nAdding.");
    script.push(close);
    script.extend(tok.encode_ordinary("think"));
    script.extend([sep, open]);
    script.extend(tok.encode_ordinary("response"));
    script.push(sep);
    script.extend(tok.encode_ordinary("Calling add."));
    script.push(close);
    script.extend(tok.encode_ordinary("response"));
    script.extend([sep, open]);
    script.extend(tok.encode_ordinary("tool_call name=\"add\""));
    script.push(sep);
    let args_at = script.len();
    script.extend(tok.encode_ordinary("{\"a\":7}"));
    script.push(close);
    script.extend(tok.encode_ordinary("tool_call"));
    script.extend([sep, close]);
    script.extend(tok.encode_ordinary("message"));
    script.extend([sep, end]);
    let vocab = tok.vocab_len();
    let opts = deltafin_sched::GenerateOptions::new(script.len()).constraint(Some(c));
    for (p, &id) in script.iter().enumerate() {
        let logits: Vec<f32> = (0..vocab).map(|i| if i == id as usize { 1.0 } else { 0.0 }).collect();
        assert_eq!(opts.next_token(&logits, p).unwrap(), id, "token {p} of the script is allowed");
    }
    // Arguments the schema refuses are not allowed: after `{"a":`, only a digit 0-9 may follow.
    let c = g.tool_turn(&tools).unwrap();
    let opts = deltafin_sched::GenerateOptions::new(999).constraint(Some(c));
    let args_prefix = tok.encode_ordinary("{\"a\":");
    let pos = script[..args_at].iter().chain(&args_prefix).enumerate().map(|(p, &id)| {
        let logits: Vec<f32> = (0..vocab).map(|i| if i == id as usize { 1.0 } else { 0.0 }).collect();
        assert_eq!(opts.next_token(&logits, p).unwrap(), id);
        p
    });
    let next = pos.last().unwrap() + 1;
    let want = tok.encode_ordinary("x")[0];
    let logits: Vec<f32> = (0..vocab).map(|i| if i == want as usize { 5.0 } else { 0.0 }).collect();
    let got = opts.next_token(&logits, next).unwrap();
    assert!(tok.decode(&[got]).starts_with(|c: char| c.is_ascii_digit()), "{:?} after {{\"a\": is not a digit", tok.decode(&[got]));
}
