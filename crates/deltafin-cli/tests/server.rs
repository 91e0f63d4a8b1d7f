//! `deltafin serve` over loopback: shapes of JSON and SSE responses, exact semantics (greedy,
//! stop, logprobs from real logits), every refusal, auth, body limits, the queue and 429,
//! client disconnects, follow-up reuse identical to a cold run, and the official `openai`
//! Python client (when installed; CI installs it).

use std::io::Write;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

use common::server::*;
use common::skipped;

#[test]
fn chat_and_completion_shapes_and_determinism() {
    let s = start(&[]);
    let (st, a) = s.json("/v1/chat/completions", &chat_body("Numbers matter here", 6));
    assert_eq!(st, 200);
    assert_eq!(a["object"], "chat.completion");
    assert!(a["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let c = &a["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 6);
    assert_eq!(a["usage"]["total_tokens"].as_u64().unwrap(), a["usage"]["prompt_tokens"].as_u64().unwrap() + 6);
    assert!(a["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    for k in ["ttft_ms", "predicted_per_second", "expert_bytes_read", "cache_hit_rate"] {
        assert!(a["timings"].get(k).is_some(), "timings.{k}");
    }
    let text = |v: &Value| format!("{}|{}", v["choices"][0]["message"]["reasoning_content"], v["choices"][0]["message"]["content"]);
    let (_, b) = s.json("/v1/chat/completions", &chat_body("Numbers matter here", 6));
    assert_eq!(text(&a), text(&b), "same request, same output");
    // top_p without a temperature, or temperature 0, change nothing: greedy is the default.
    let mut cold = chat_body("Numbers matter here", 6);
    cold["temperature"] = json!(0);
    cold["top_p"] = json!(0.5);
    assert_eq!(text(&s.json("/v1/chat/completions", &cold).1), text(&a));
    // A temperature samples, with the seed the response names: the same again with it.
    let mut hot = chat_body("Numbers matter here", 6);
    hot["temperature"] = json!(1.5);
    let first = s.json("/v1/chat/completions", &hot).1;
    hot["seed"] = first["seed"].clone();
    assert!(first["seed"].is_u64(), "{first}");
    assert_eq!(text(&s.json("/v1/chat/completions", &hot).1), text(&first));
    // Completions: the fixture's reference continuation.
    let (st, c) = s.json("/v1/completions", &json!({"prompt": "Numbers matter here too: 12 boats and 42 answers.", "max_tokens": 3}));
    assert_eq!(st, 200);
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["choices"][0]["text"], " exper\u{fffd}re");
    let (st, _, body) = s.request("GET", "/v1/models", None, &[]).unwrap();
    assert_eq!(st, 200);
    assert!(body.contains("\"object\":\"list\""));
}

#[test]
fn streaming_matches_whole_response_and_ends_with_done() {
    let s = start(&[]);
    let (_, whole) = s.json("/v1/chat/completions", &chat_body("stream me", 5));
    let mut req = chat_body("stream me", 5);
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let (st, head, body) = s.post("/v1/chat/completions", &req);
    assert_eq!(st, 200);
    assert!(head.to_ascii_lowercase().contains("text/event-stream"));
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut reasoning = String::new();
    let mut content = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(ch) = c["choices"].get(0) {
            reasoning += ch["delta"]["reasoning_content"].as_str().unwrap_or("");
            content += ch["delta"]["content"].as_str().unwrap_or("");
        }
    }
    let last_choice = chunks.iter().rev().find(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty())).unwrap();
    assert_eq!(last_choice["choices"][0]["finish_reason"], "length");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(reasoning, whole["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or(""));
    assert_eq!(content, whole["choices"][0]["message"]["content"].as_str().unwrap_or(""));
}

#[test]
fn stop_and_logprobs_are_exact() {
    let s = start(&[]);
    let prompt = "Numbers matter here too: 12 boats and 42 answers.";
    let (_, full) = s.json("/v1/completions", &json!({"prompt": prompt, "max_tokens": 8, "logprobs": 3}));
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let lp = &full["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 8);
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let best = top.as_object().unwrap().values().map(|v| v.as_f64().unwrap()).fold(f64::MIN, f64::max);
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!((best - chosen).abs() < 1e-6 && chosen <= 0.0, "greedy picks the most likely token");
    }
    // A stop string from the middle of the output cuts it right there.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let (_, cut) = s.json("/v1/completions", &json!({"prompt": prompt, "max_tokens": 8, "stop": [stop.clone()]}));
    let want = &text[..text.find(&stop).unwrap()];
    assert_eq!(cut["choices"][0]["text"], want);
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    // The same in a stream.
    let (_, _, body) = s.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 8, "stop": stop, "stream": true}));
    let data = sse_data(&body);
    let streamed: String = data
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(streamed, want);
    // Chat logprobs.
    let mut req = chat_body("hi", 3);
    req["logprobs"] = json!(true);
    req["top_logprobs"] = json!(2);
    let (_, c) = s.json("/v1/chat/completions", &req);
    let items = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(items.len(), 3);
    assert_eq!(items[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(items[0]["top_logprobs"][0]["logprob"], items[0]["logprob"]);
}

#[test]
fn refusals_are_openai_shaped_400s_naming_the_field() {
    let s = start(&["--max-body", "2K"]);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"messages": msgs, "n": 3}), "n"),
        (json!({"messages": msgs, "tools": [{"type": "function"}]}), "tools[0]"),
        (json!({"messages": msgs, "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": msgs, "presence_penalty": 1.0}), "presence_penalty"),
        (json!({"messages": msgs, "logit_bias": {"5": 10}}), "logit_bias"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]}),
            "messages[0].content[0]",
        ),
        (json!({"messages": msgs, "mystery": true}), "mystery"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": msgs, "temperature": -1}), "temperature"),
    ];
    for (body, param) in cases {
        let (st, v) = s.json("/v1/chat/completions", &body);
        assert_eq!(st, 400, "{body}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().contains(param.split('[').next().unwrap()), "{v}");
    }
    let (st, v) = s.json("/v1/completions", &json!({"prompt": ""}));
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("prompt")));
    let (st, _, body) = s.request("POST", "/v1/chat/completions", Some(b"{not json"), &[]).unwrap();
    assert_eq!(st, 400, "{body}");
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(4000)}]});
    let (st, _, _) = s.post("/v1/chat/completions", &big);
    assert_eq!(st, 413);
    let (_, _, metrics) = s.request("GET", "/metrics", None, &[]).unwrap();
    assert!(metrics.contains("deltafin_requests_total{status=\"400\"}"));
}

#[test]
fn api_key_is_required_when_set() {
    let s = start(&["--api-key", "sekrit"]);
    let (st, _, _) = s.post("/v1/chat/completions", &chat_body("hi", 1));
    assert_eq!(st, 401);
    let (st, _, _) = s
        .request("POST", "/v1/chat/completions", Some(chat_body("hi", 1).to_string().as_bytes()), &[("Authorization", "Bearer sekrit")])
        .unwrap();
    assert_eq!(st, 200);
}

/// Turn two of a conversation that began with `question`: its reply as the server gave it, and a
/// new question.
fn follow_up(question: &str, first: &Value) -> Value {
    let reply = &first["choices"][0]["message"];
    json!({"messages": [
        {"role": "user", "content": question},
        {"role": "assistant", "content": reply["content"], "reasoning_content": reply["reasoning_content"]},
        {"role": "user", "content": "and then?"}
    ], "max_tokens": 6})
}

#[test]
fn conversations_taking_turns_reuse_their_state_with_identical_output() {
    let questions = ["Numbers matter here", "Letters are another matter entirely"];
    let cold_server = start(&[]);
    for mode in [&[][..], &["--max-batch", "4"][..]] {
        let s = start(mode);
        // Both conversations' first turns, then both second turns: each finds its own state.
        let firsts: Vec<Value> = questions.iter().map(|q| s.json("/v1/chat/completions", &chat_body(q, 4)).1).collect();
        for (q, first) in questions.iter().zip(&firsts) {
            let follow = follow_up(q, first);
            let (_, warm) = s.json("/v1/chat/completions", &follow);
            let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
            assert!(cached > 10, "{mode:?}: the follow-up of {q:?} reused its first prompt's state ({cached} tokens)");
            let (_, cold) = cold_server.json("/v1/chat/completions", &follow);
            assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
            assert_eq!(warm["choices"][0]["message"], cold["choices"][0]["message"], "{mode:?}: reuse must not change a token");
        }
    }
    let s = start(&["--keep-states", "0"]);
    let first = s.json("/v1/chat/completions", &chat_body(questions[0], 4)).1;
    let (_, again) = s.json("/v1/chat/completions", &follow_up(questions[0], &first));
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "--keep-states 0 keeps nothing");
}

#[test]
fn queue_overflow_gets_429_and_disconnect_frees_the_engine() {
    // Generations long enough to outlast the test's steps on a fast machine (500 tokens of the
    // tiny model take a third of a second on some).
    let s = start(&["--max-queue", "1", "--context", "4096"]);
    // Long generations occupy the engine; the client connections are left open.
    let long = json!({"prompt": "Numbers", "max_tokens": 4000, "stream": true});
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
        let b = long.to_string();
        write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len())
            .unwrap();
        held.push(c);
        std::thread::sleep(Duration::from_millis(300));
    }
    let (st, head, v) = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    assert_eq!(st, 429, "{v}");
    assert!(head.to_ascii_lowercase().contains("retry-after"));
    // Both clients go away: their generations stop and a new request is served quickly.
    drop(held);
    let t0 = Instant::now();
    loop {
        let (st, _, _) = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
        if st == 200 {
            break;
        }
        assert_eq!(st, 429);
        assert!(t0.elapsed() < Duration::from_secs(10), "the abandoned generations kept the engine busy");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, _, metrics) = s.request("GET", "/metrics", None, &[]).unwrap();
    let value = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} in {metrics}"))
    };
    assert!(value("deltafin_cancelled_total") >= 2, "both abandoned generations were cancelled: {metrics}");
    assert!(value("deltafin_generated_tokens_total") < 8000, "the abandoned generations did not run to their 4000 tokens each");
}

#[test]
#[cfg_attr(
    not(has_py_openai),
    ignore = "the `openai` Python package is not installed: pip install openai, then touch crates/deltafin-cli/build.rs"
)]
fn official_openai_python_client() {
    let has = Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success());
    if !has {
        skipped("the `openai` Python package is not installed (pip install openai)", true);
        return;
    }
    let s = start(&[]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = Command::new("python3").arg(script).arg(format!("http://127.0.0.1:{}/v1", s.port)).output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_panicking_generation_leaves_the_server_up() {
    let s = start_env(&[], &[("DELTAFIN_FAULT_PANIC_ON_TOKEN", "999")]);
    let (st, v) = s.json("/v1/completions", &json!({"prompt": "Numbers", "max_tokens": 2}));
    assert_eq!(st, 200, "{v}");
    // " Movie" is token 999 of the fixture's vocabulary: it triggers the injected panic.
    let (st, v) = s.json("/v1/completions", &json!({"prompt": "A Movie", "max_tokens": 2}));
    assert_eq!(st, 500, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("panicked"), "{v}");
    let (st, _) = s.json("/v1/completions", &json!({"prompt": "Numbers", "max_tokens": 2}));
    assert_eq!(st, 200, "the server still serves");
    let (_, _, metrics) = s.request("GET", "/metrics", None, &[]).unwrap();
    assert!(metrics.contains("deltafin_panics_total 1"), "{metrics}");
}

#[test]
fn streamed_requests_waiting_in_the_queue_get_keep_alives() {
    let s = start(&["--keep-alive", "1", "--max-queue", "4", "--context", "4096"]);
    let busy = std::thread::spawn({
        let port = s.port;
        move || {
            let s2 = Server { child: Command::new("true").spawn().unwrap(), port };
            let r = s2.post("/v1/completions", &json!({"prompt": "Numbers", "max_tokens": 3000}));
            std::mem::forget(s2);
            r
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    let (st, _, body) = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 2, "stream": true}));
    assert_eq!(st, 200);
    assert!(body.contains(": keep-alive"), "a waiting stream gets keep-alive comments: {body}");
    assert!(body.trim_end().ends_with("data: [DONE]"));
    assert_eq!(busy.join().unwrap().0, 200);
}

/// Replaces what legitimately changes between runs (ids, clocks, timings) with placeholders.
fn normalize(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        for (k, x) in o.iter_mut() {
            match k.as_str() {
                "id" => *x = json!("ID"),
                "created" => *x = json!(0),
                "timings" => {
                    if let Some(t) = x.as_object_mut() {
                        for (tk, tv) in t.iter_mut() {
                            if tk != "prompt_n" && tk != "predicted_n" && tk != "cached_n" {
                                *tv = json!(0);
                            }
                        }
                    }
                }
                _ => *x = normalize(x.take()),
            }
        }
    } else if let Some(a) = v.as_array_mut() {
        for x in a.iter_mut() {
            *x = normalize(x.take());
        }
    }
    v
}

fn snapshot(name: &str, got: &Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots").join(format!("{name}.json"));
    let text = serde_json::to_string_pretty(got).unwrap() + "\n";
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let want =
        std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("missing snapshot {} (run with UPDATE_SNAPSHOTS=1)", path.display()));
    assert_eq!(text, want, "response shape changed for {name}; review and re-run with UPDATE_SNAPSHOTS=1 if intended");
}

#[test]
fn json_and_sse_shapes_match_snapshots() {
    let s = start(&[]);
    let mut req = chat_body("Numbers matter here", 3);
    req["logprobs"] = json!(true);
    req["top_logprobs"] = json!(1);
    snapshot("chat", &normalize(s.json("/v1/chat/completions", &req).1));
    snapshot("completion", &normalize(s.json("/v1/completions", &json!({"prompt": "Numbers matter", "max_tokens": 3, "logprobs": 1})).1));
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let (_, _, body) = s.post("/v1/chat/completions", &req);
    let events: Vec<Value> = sse_data(&body)
        .into_iter()
        .map(|d| if d == "[DONE]" { json!("[DONE]") } else { normalize(serde_json::from_str(&d).unwrap()) })
        .collect();
    snapshot("chat_stream", &json!(events));
    let (_, _, body) = s.post("/v1/completions", &json!({"prompt": "Numbers matter", "max_tokens": 2, "stream": true}));
    let events: Vec<Value> = sse_data(&body)
        .into_iter()
        .map(|d| if d == "[DONE]" { json!("[DONE]") } else { normalize(serde_json::from_str(&d).unwrap()) })
        .collect();
    snapshot("completion_stream", &json!(events));
    snapshot("refusal", &s.json("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "n": 2})).1);
}

#[test]
fn eight_concurrent_streams_in_lockstep_get_their_solo_outputs() {
    let prompts: Vec<String> = (0..8).map(|i| format!("Request {i}: tell me about {} boats", 3 * i + 1)).collect();
    let body = |p: &str, stream: bool| {
        let mut b = chat_body(p, 6 + prompts.iter().position(|q| q == p).unwrap());
        b["logprobs"] = json!(true);
        b["stream"] = json!(stream);
        b
    };
    let solo = start(&[]);
    let want: Vec<Value> = prompts.iter().map(|p| solo.json("/v1/chat/completions", &body(p, false)).1).collect();
    drop(solo);
    let s = start(&["--max-batch", "8"]);
    let got: Vec<(Value, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let s = &s;
                scope.spawn(move || {
                    let (st, _, streamed) = s.post("/v1/chat/completions", &body(p, true));
                    assert_eq!(st, 200);
                    let (_, whole) = s.json("/v1/chat/completions", &body(p, false));
                    (whole, streamed)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ((whole, streamed), want)) in got.iter().zip(&want).enumerate() {
        assert_eq!(whole["choices"][0]["message"], want["choices"][0]["message"], "request {i}: whole response differs from solo");
        assert_eq!(whole["choices"][0]["logprobs"], want["choices"][0]["logprobs"], "request {i}: logprobs differ from solo");
        assert_eq!(whole["usage"]["completion_tokens"], want["usage"]["completion_tokens"]);
        // The stream carries the same text.
        let text: String = sse_data(streamed)
            .iter()
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
            .collect();
        assert_eq!(text, want["choices"][0]["message"]["content"].as_str().unwrap_or(""), "request {i}: streamed text");
    }
    let (_, _, metrics) = s.request("GET", "/metrics", None, &[]).unwrap();
    assert!(metrics.contains("deltafin_"), "{metrics}");
}

/// Issue 49: `--max-batch` no longer turns drafting off: with `--draft ngram` every request in
/// the lockstep batch drafts by prompt lookup, and each still gets its solo plain output.
#[test]
fn drafting_in_a_lockstep_batch_gives_each_client_its_solo_plain_output() {
    // Issue 49: 16 clients at once on 4 slots with prompt-lookup drafts, then follow-ups.
    let prompts: Vec<String> = (0..16)
        .map(|i| {
            let r = "red ".repeat(i % 6 + 1);
            format!("{r} {i} boats, {r} {i} boats, {r} {i} boats")
        })
        .collect();
    let plain = start(&[]);
    let want: Vec<Value> = prompts.iter().map(|p| plain.json("/v1/chat/completions", &chat_body(p, 24)).1).collect();
    // Room to keep every conversation (each keeps two states: after its prompt, and finished).
    let s = start(&["--max-batch", "4", "--draft", "ngram", "--keep-states", "32", "--max-queue", "16"]);
    let all = |bodies: Vec<Value>| -> Vec<Value> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = bodies.iter().map(|b| scope.spawn(|| s.json("/v1/chat/completions", b).1)).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let got = all(prompts.iter().map(|p| chat_body(p, 24)).collect());
    let (mut drafted, mut accepted) = (0, 0);
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"], "request {i} differs from its solo plain run");
        drafted += got["timings"]["drafted_n"].as_u64().unwrap();
        accepted += got["timings"]["accepted_n"].as_u64().unwrap();
    }
    assert!(drafted > 0 && accepted > 0, "the requests drafted and kept drafts where text repeats: {got:?}");
    // Follow-ups of four conversations, at once, resume from their kept states and answer as a
    // cold server does.
    let follows: Vec<Value> = [0, 5, 10, 15].iter().map(|&i| follow_up(&prompts[i], &got[i])).collect();
    let warm = all(follows.clone());
    for (f, w) in follows.iter().zip(&warm) {
        let cold = plain.json("/v1/chat/completions", f).1;
        assert_eq!(w["choices"][0]["message"], cold["choices"][0]["message"], "a follow-up differs from a cold run");
    }
    let cached: Vec<u64> = warm.iter().map(|w| w["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()).collect();
    assert!(cached.iter().all(|&c| c > 10), "every follow-up reused its kept state: {cached:?}");
}

#[test]
fn echo_scores_prompt_tokens_with_the_logprobs_generation_reports() {
    let s = start(&[]);
    let prompt = "Numbers matter here too: 12 boats and 42 answers.";
    // Generate one token with its logprob...
    let (st, g) = s.json("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1, "logprobs": 2}));
    assert_eq!(st, 200);
    let next = g["choices"][0]["text"].as_str().unwrap().to_string();
    let next_lp = g["choices"][0]["logprobs"]["token_logprobs"][0].as_f64().unwrap();
    // ...then score prompt + that token: its last logprob is the same number, bit for bit.
    let scored = format!("{prompt}{next}");
    let (st, e) = s.json("/v1/completions", &json!({"prompt": scored, "max_tokens": 0, "echo": true, "logprobs": 2}));
    assert_eq!(st, 200, "{e}");
    let c = &e["choices"][0];
    assert_eq!(c["text"], scored, "echo returns the prompt");
    let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len() as u64, e["usage"]["prompt_tokens"].as_u64().unwrap());
    assert!(lps[0].is_null() && c["logprobs"]["top_logprobs"][0].is_null(), "nothing precedes the first token");
    assert!(lps[1..].iter().all(|x| x.as_f64().is_some_and(|v| v <= 0.0)));
    assert_eq!(lps.last().unwrap().as_f64().unwrap(), next_lp, "scoring and generation disagree");
    assert_eq!(c["logprobs"]["top_logprobs"][1].as_object().unwrap().len(), 2);
    assert_eq!(e["usage"]["completion_tokens"], 0);
    // With a completion: the prompt's scores, then the generated tokens'.
    let (_, both) = s.json("/v1/completions", &json!({"prompt": prompt, "max_tokens": 2, "echo": true, "logprobs": 0}));
    let n = both["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(both["choices"][0]["logprobs"]["tokens"].as_array().unwrap().len(), n + 2);
    assert!(both["choices"][0]["text"].as_str().unwrap().starts_with(prompt));
    // Refusals: echo cannot stream, max_tokens 0 needs echo.
    assert_eq!(s.json("/v1/completions", &json!({"prompt": prompt, "echo": true, "stream": true})).0, 400);
    assert_eq!(s.json("/v1/completions", &json!({"prompt": prompt, "max_tokens": 0})).0, 400);
    // The same in lockstep, many at once.
    drop(s);
    let s = start(&["--max-batch", "4"]);
    let (_, again) = s.json("/v1/completions", &json!({"prompt": scored, "max_tokens": 0, "echo": true, "logprobs": 2}));
    assert_eq!(again["choices"][0]["logprobs"], c["logprobs"]);
}
