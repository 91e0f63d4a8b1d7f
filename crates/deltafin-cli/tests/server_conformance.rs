//! What people hit next with the server (issue 19's list), each with the test that would have
//! caught it: defaults clamped to the context, JSON for every HTTP error, `models.retrieve`,
//! harmless defaults accepted, metrics that count stop strings and parse as Prometheus text,
//! security defaults, ids unique across restarts, graceful shutdown, a missing model exiting.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::server::*;
use common::{bin, has_npm, skipped, PROMPT_IDS, PROMPT_TEXT};
use serde_json::{json, Value};

#[test]
fn the_default_max_tokens_is_clamped_to_the_context_and_errors_name_the_prompt() {
    let s = start(&["--context", "160", "--default-max-tokens", "512"]);
    let long = "Numbers matter here too: 12 boats and 42 answers. ".repeat(3);
    let (st, v) = s.json("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": long}]}));
    assert_eq!(st, 200, "{v}");
    let u = &v["usage"];
    assert!(u["completion_tokens"].as_u64().unwrap() >= 1 && u["total_tokens"].as_u64().unwrap() <= 160, "{v}");
    // A max_tokens the client did set is honoured or refused, naming what overflows.
    let (st, v) = s.json("/v1/completions", &json!({"prompt": long, "max_tokens": 90}));
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("prompt")), "{v}");
    let (st, v) = s.json("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": long}], "max_tokens": 90}));
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("messages")), "{v}");
}

#[test]
fn every_http_error_is_json_and_models_retrieve_works() {
    let s = start(&["--max-body", "1K"]);
    let (st, head, body) = s.request("GET", "/v1/nothing", None, &[]).unwrap();
    assert_eq!(st, 404);
    assert!(head.to_ascii_lowercase().contains("application/json"));
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["type"], "not_found_error");
    let (st, _, body) = s.request("DELETE", "/v1/chat/completions", None, &[]).unwrap();
    assert_eq!(st, 405);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"]["message"].as_str().unwrap().contains("DELETE"));
    let big = json!({"prompt": "x".repeat(2000)});
    let (st, _, body) = s.post("/v1/completions", &big);
    assert_eq!(st, 413);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"]["message"].as_str().unwrap().contains("--max-body"));
    let (_, _, list) = s.request("GET", "/v1/models", None, &[]).unwrap();
    let id = serde_json::from_str::<Value>(&list).unwrap()["data"][0]["id"].as_str().unwrap().to_string();
    let (st, _, one) = s.request("GET", &format!("/v1/models/{id}"), None, &[]).unwrap();
    assert_eq!(st, 200);
    assert_eq!(serde_json::from_str::<Value>(&one).unwrap()["id"], id.as_str());
    let (st, _, _) = s.request("GET", "/v1/models/gpt-4", None, &[]).unwrap();
    assert_eq!(st, 404);
}

#[test]
fn harmless_defaults_are_accepted_and_token_id_prompts_match_text() {
    let s = start(&[]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {"type": "text"},
        "tool_choice": "none", "top_k": 1});
    let (st, v) = s.json("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let ids: Vec<u32> = PROMPT_IDS.split(',').map(|x| x.parse().unwrap()).collect();
    let (_, by_text) = s.json("/v1/completions", &json!({"prompt": PROMPT_TEXT, "max_tokens": 6}));
    for prompt in [json!(ids), json!([ids])] {
        let (st, by_ids) = s.json("/v1/completions", &json!({"prompt": prompt, "max_tokens": 6}));
        assert_eq!(st, 200, "{by_ids}");
        assert_eq!(by_ids["choices"][0]["text"], by_text["choices"][0]["text"]);
    }
    let (st, v) = s.json("/v1/completions", &json!({"prompt": [1, 999999999]}));
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("prompt")), "{v}");
}

#[test]
fn metrics_count_stop_strings_and_errors_and_parse_as_prometheus_text() {
    let s = start(&[]);
    // Find a string the reply contains, then stop on it.
    let (_, free) = s.json("/v1/completions", &json!({"prompt": PROMPT_TEXT, "max_tokens": 8}));
    let text = free["choices"][0]["text"].as_str().unwrap().to_string();
    let stop: String = text.chars().skip(text.chars().count() / 2).take(2).collect();
    let (st, v) = s.json("/v1/completions", &json!({"prompt": PROMPT_TEXT, "max_tokens": 8, "stop": [stop]}));
    assert_eq!(st, 200);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["timings"].is_object(), "a reply ended by a stop string has its timings: {v}");
    let _ = s.request("GET", "/v1/missing", None, &[]).unwrap();
    let (_, _, text) = s.request("GET", "/metrics", None, &[]).unwrap();
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text");
    let value = |name: &str, status: Option<&str>| -> f64 {
        let m = scrape
            .samples
            .iter()
            .find(|m| m.metric == name && status.is_none_or(|st| m.labels.get("status") == Some(st)))
            .unwrap_or_else(|| panic!("{name} {status:?} in {text}"));
        match &m.value {
            prometheus_parse::Value::Counter(x) | prometheus_parse::Value::Gauge(x) | prometheus_parse::Value::Untyped(x) => *x,
            prometheus_parse::Value::Histogram(h) => h.last().map_or(0.0, |b| b.count),
            prometheus_parse::Value::Summary(_) => f64::NAN,
        }
    };
    assert_eq!(value("deltafin_generations_total", None), 2.0, "the stopped reply is a finished generation");
    assert_eq!(value("deltafin_cancelled_total", None), 0.0, "a stop string is not a client gone");
    assert!(value("deltafin_generated_tokens_total", None) >= 9.0);
    assert_eq!(value("deltafin_requests_total", Some("404")), 1.0);
    assert_eq!(value("deltafin_ttft_seconds", None), 2.0, "the TTFT histogram counts both");
    assert!(text.contains("deltafin_ttft_seconds_count 2"), "{text}");
}

#[test]
fn security_defaults_metrics_behind_the_key_any_case_bearer_and_a_body_timeout() {
    let s = start(&["--api-key", "sekrit", "--body-timeout", "1"]);
    let (st, head, _) = s.request("GET", "/metrics", None, &[]).unwrap();
    assert_eq!(st, 401);
    assert!(head.to_ascii_lowercase().contains("www-authenticate: bearer"), "{head}");
    let (st, _, _) = s.request("GET", "/metrics", None, &[("Authorization", "bearer sekrit")]).unwrap();
    assert_eq!(st, 200);
    let (st, _, _) = s.request("GET", "/v1/models", None, &[("Authorization", "BEARER sekrit")]).unwrap();
    assert_eq!(st, 200);
    let (st, _, _) = s.request("GET", "/v1/models", None, &[("Authorization", "Bearer SEKRIT")]).unwrap();
    assert_eq!(st, 401, "the key itself is case-sensitive");
    // A body that never finishes arriving gets 408 instead of holding the connection.
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"pro").unwrap();
    let t0 = Instant::now();
    let mut got = vec![0u8; 512];
    let n = c.read(&mut got).unwrap();
    assert!(String::from_utf8_lossy(&got[..n]).starts_with("HTTP/1.1 408"), "{}", String::from_utf8_lossy(&got[..n]));
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn listening_beyond_loopback_without_a_key_warns() {
    let mut child = bin()
        .args(["serve", "--host", "0.0.0.0", "--port", "0", "--model"])
        .arg(common::fixture())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("without --api-key"), "{err}");
}

#[test]
fn response_ids_differ_across_restarts() {
    let first = |s: &Server| s.json("/v1/completions", &json!({"prompt": "x", "max_tokens": 1})).1["id"].as_str().unwrap().to_string();
    let a = first(&start(&[]));
    let b = first(&start(&[]));
    assert_ne!(a, b);
    assert!(a.starts_with("cmpl-"));
}

#[test]
fn sigterm_finishes_a_running_stream_with_done_and_exits_cleanly() {
    let s = start(&[]);
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = json!({"prompt": "Numbers", "max_tokens": 200, "stream": true}).to_string();
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len())
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let pid = s.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let mut all = String::new();
    let _ = c.read_to_string(&mut all);
    assert!(all.contains("data: [DONE]"), "the stream ends properly: {all}");
    let mut s = s;
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the server exits after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_model_that_is_missing_or_fails_to_load_ends_the_server_with_an_error() {
    let out = bin().args(["serve", "--model", "/nonexistent/model", "--port", "1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such model"), "{}", String::from_utf8_lossy(&out.stderr));
    // A folder that exists but is no model: the load fails after listening; the server exits.
    let tmp = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let out = bin().args(["serve", "--port", "0", "--model"]).arg(tmp.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("loading the model failed"));
    assert!(t0.elapsed() < Duration::from_secs(20));
}

/// A recorded K3 reply that reasons, then calls a tool (what no random model emits).
const TOOL_REPLY: &str = "planning<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tool_call id=\"call_7\" name=\"get_weather\"<|sep|>{\"city\": \"Paris\"}<|close|>tool_call<|sep|><|close|>message<|sep|><|end_of_msg|>";

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
}

#[test]
fn tool_calls_of_a_recorded_reply_come_back_whole_and_streamed() {
    let s = start_env(&[], &[("DELTAFIN_REPLAY_REPLY", TOOL_REPLY)]);
    let body = json!({"messages": [{"role": "user", "content": "weather?"}], "tools": tools()});
    let (st, v) = s.json("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["content"], Value::Null);
    assert_eq!(c["message"]["reasoning_content"], "planning");
    let call = &c["message"]["tool_calls"][0];
    assert_eq!((call["id"].as_str(), call["function"]["name"].as_str()), (Some("call_7"), Some("get_weather")));
    assert_eq!(call["function"]["arguments"], "{\"city\": \"Paris\"}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, _, text) = s.post("/v1/chat/completions", &streamed);
    let (mut args, mut name, mut finish) = (String::new(), String::new(), String::new());
    for d in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(d).unwrap();
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = f.to_string();
        }
        for t in v["choices"][0]["delta"]["tool_calls"].as_array().into_iter().flatten() {
            name.push_str(t["function"]["name"].as_str().unwrap_or(""));
            args.push_str(t["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    assert_eq!((name.as_str(), args.as_str(), finish.as_str()), ("get_weather", "{\"city\": \"Paris\"}", "tool_calls"));
}

#[test]
#[cfg_attr(
    not(has_py_openai),
    ignore = "the `openai` Python package is not installed: pip install openai, then touch crates/deltafin-cli/build.rs"
)]
fn the_official_python_client_parses_tool_calls_whole_and_streamed() {
    run_client(
        "python3",
        &["-c", "import openai"],
        "tests/openai_tools.py",
        "the `openai` Python package is not installed (pip install openai)",
    );
}

#[test]
fn a_required_or_named_tool_choice_opens_the_call_for_the_model() {
    let s = start(&[]);
    let msgs = json!([{"role": "user", "content": "weather?"}]);
    let tokens = |choice: Value| {
        let (st, v) = s.json("/v1/chat/completions", &json!({"messages": msgs, "tools": tools(), "tool_choice": choice, "max_tokens": 3}));
        assert_eq!(st, 200, "{v}");
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let auto = tokens(json!("auto"));
    let required = tokens(json!("required"));
    let named = tokens(json!({"type": "function", "function": {"name": "get_weather"}}));
    // The prompt opens the call: an empty think, `tool_call`, and for a named call its name.
    assert!(required > auto && named > required, "{auto} {required} {named}");
    assert!(tokens(json!("none")) < auto, "no tool declared with tool_choice none");
    let (st, v) = s.json(
        "/v1/chat/completions",
        &json!({"messages": msgs, "tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    );
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("tool_choice")));
}

/// Issue 51.2: a required or named call's arguments are constrained to its tool's `parameters`,
/// whatever the fixture's random weights prefer.
#[test]
fn a_required_call_is_a_declared_tool_with_arguments_its_schema_accepts() {
    let s = start(&["--context", "1024"]);
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": false}}}
    ]);
    let named = json!({"type": "function", "function": {"name": "add"}});
    for (i, (prompt, choice)) in
        [("weather in Oslo?", json!("required")), ("2 + 3?", json!("required")), ("sum", named)].into_iter().enumerate()
    {
        let body = json!({"messages": [{"role": "user", "content": prompt}], "tools": tools, "tool_choice": choice, "max_tokens": 200});
        let (st, v) = s.json("/v1/chat/completions", &body);
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "case {i}: {v}");
        let f = &c["message"]["tool_calls"][0]["function"];
        let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap_or_else(|e| panic!("case {i}: {f}: {e}"));
        match f["name"].as_str().unwrap() {
            "get_weather" => {
                assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{args}");
                assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()), "{args}");
                assert_eq!(args.as_object().unwrap().len(), 2, "{args}");
            }
            "add" => assert!(args["a"].as_i64().is_some_and(|a| (0..=99).contains(&a)) && args["b"].is_i64(), "{args}"),
            other => panic!("case {i}: undeclared tool {other}"),
        }
        if i == 2 {
            assert_eq!(f["name"], "add", "the named tool");
        }
    }
}

#[test]
fn reasoning_is_apart_by_default_and_folded_into_content_when_asked() {
    let reply = "weighing it<|close|>think<|sep|><|open|>response<|sep|>Hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>";
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    for fold in [false, true] {
        let s = start_env(if fold { &["--reasoning-in-content"] } else { &[] }, &[("DELTAFIN_REPLAY_REPLY", reply)]);
        let (_, v) = s.json("/v1/chat/completions", &body);
        let m = &v["choices"][0]["message"];
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (_, _, text) = s.post("/v1/chat/completions", &streamed);
        let (mut content, mut reasoning) = (String::new(), String::new());
        for d in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
            let v: Value = serde_json::from_str(d).unwrap();
            content.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
            reasoning.push_str(v["choices"][0]["delta"]["reasoning_content"].as_str().unwrap_or(""));
        }
        if fold {
            assert_eq!(m["content"], "<think>weighing it</think>Hello", "{v}");
            assert!(m.get("reasoning_content").is_none(), "{v}");
            assert_eq!((content.as_str(), reasoning.as_str()), ("<think>weighing it</think>Hello", ""));
        } else {
            assert_eq!((m["content"].as_str(), m["reasoning_content"].as_str()), (Some("Hello"), Some("weighing it")), "{v}");
            assert_eq!((content.as_str(), reasoning.as_str()), ("Hello", "weighing it"));
        }
    }
}

/// Runs a client script against a server replaying [`TOOL_REPLY`], if its runtime and package
/// are installed (`.ci/run` installs them); `check` is the import that must succeed first.
fn run_client(program: &str, check: &[&str], script: &str, setup_hint: &str) {
    let has = Command::new(program).args(check).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    if !has {
        skipped(setup_hint, program != "node" || has_npm());
        return;
    }
    let s = start_env(&[], &[("DELTAFIN_REPLAY_REPLY", TOOL_REPLY)]);
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(script);
    let out = Command::new(program).arg(script).arg(format!("http://127.0.0.1:{}/v1", s.port)).output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok"));
}

#[test]
#[cfg_attr(
    not(has_node_openai),
    ignore = "node or the `openai` npm package is not installed: npm ci --prefix crates/deltafin-cli/tests/node"
)]
fn the_official_node_client_exercises_models_chat_streams_tools_and_errors() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/node");
    let check = format!("{}/node_modules/openai/package.json", dir.display());
    let has = std::path::Path::new(&check).exists();
    if !has {
        skipped(&format!("the `openai` npm package is not installed (npm ci --prefix {})", dir.display()), has_npm());
        return;
    }
    run_client("node", &["--version"], "tests/node/client.mjs", "node is not installed");
}

#[test]
#[cfg_attr(
    not(has_py_langchain),
    ignore = "the `langchain-openai` Python package is not installed: pip install langchain-openai, then touch crates/deltafin-cli/build.rs"
)]
fn langchain_openai_binds_tools_invokes_and_streams() {
    run_client(
        "python3",
        &["-c", "import langchain_openai"],
        "tests/langchain_client.py",
        "langchain-openai is not installed (pip install langchain-openai)",
    );
}

#[test]
fn a_client_gone_during_its_prompt_is_counted_as_cancelled() {
    let s = start(&["--context", "4096"]);
    let long = "numbers and boats ".repeat(560);
    let body = json!({"prompt": long, "max_tokens": 200}).to_string();
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len())
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    drop(c);
    let t0 = Instant::now();
    loop {
        let (_, _, text) = s.request("GET", "/metrics", None, &[]).unwrap();
        let value = |name: &str| text.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).map(|v| v.trim().to_string());
        if value("deltafin_cancelled_total").as_deref() == Some("1") {
            assert_eq!(value("deltafin_generations_total").as_deref(), Some("0"), "{text}");
            assert_eq!(
                value("deltafin_requests_total{status=\"200\"}").as_deref(),
                Some("0"),
                "a request that never answered is not a 200: {text}"
            );
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the disconnect was not counted: {text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Seeded sampling through the API: the same request with the same seed gives the same text run
/// after run, while other requests share its steps (`--max-batch 8`), and alone with drafts
/// (`--max-batch 1 --draft ngram`); a request without a seed is told the one it got, which
/// reproduces it; no temperature is greedy.
#[test]
fn a_seed_gives_the_same_text_alone_batched_and_drafted() {
    let body = |seed: Option<u64>| {
        let mut b = json!({"prompt": PROMPT_TEXT, "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "top_k": 50});
        if let Some(s) = seed {
            b["seed"] = json!(s);
        }
        b
    };
    let text = |s: &Server, b: &Value| {
        let (st, v) = s.json("/v1/completions", b);
        assert_eq!(st, 200, "{v}");
        (v["choices"][0]["text"].as_str().unwrap().to_string(), v["seed"].as_u64())
    };
    let batched = start(&["--max-batch", "8", "--max-queue", "16"]);
    let (want, seed) = text(&batched, &body(Some(1234)));
    assert_eq!(seed, Some(1234), "the response names its seed");
    std::thread::scope(|sc| {
        let runs: Vec<_> = (0..10)
            .map(|i| {
                let b = if i % 2 == 0 { body(Some(1234)) } else { body(Some(i)) };
                let s = &batched;
                sc.spawn(move || (i, text(s, &b).0))
            })
            .collect();
        for r in runs {
            let (i, got) = r.join().unwrap();
            if i % 2 == 0 {
                assert_eq!(got, want, "run {i}: the same seed beside other requests");
            }
        }
    });
    let (drawn, seed) = text(&batched, &body(None));
    let seed = seed.expect("a drawn seed is returned");
    assert_eq!(text(&batched, &body(Some(seed))).0, drawn, "the returned seed reproduces the text");
    let greedy = batched.json("/v1/completions", &json!({"prompt": PROMPT_TEXT, "max_tokens": 12})).1;
    assert!(greedy.get("seed").is_none(), "greedy needs no seed: {greedy}");
    drop(batched);
    let drafted = start(&["--max-batch", "1", "--draft", "ngram", "--draft-fixed"]);
    assert_eq!(text(&drafted, &body(Some(1234))).0, want, "with drafts, alone");
}
