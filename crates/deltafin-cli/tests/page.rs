//! The chat page (`GET /`) in headless Chromium, driven through ChromeDriver's WebDriver API as a
//! user would: type a message, press Enter, watch the reply stream in, stop a long one mid-reply;
//! and with `--api-key`, give the key the page asks for. `.ci/run` installs Debian's `chromium` and
//! `chromium-driver`; elsewhere, without them, cargo reports the test as ignored.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::server::*;
use serde_json::{json, Value};

/// One WebDriver exchange: (status, body). ChromeDriver keeps the connection open after its
/// answer, so the body is read by its Content-Length, not to the end of the stream.
fn webdriver(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(s);
    let (mut status, mut len) = (0u16, 0usize);
    loop {
        let mut line = String::new();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if l.starts_with("HTTP/") {
            status = l.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        } else if let Some((k, v)) = l.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut buf = vec![0; len];
    r.read_exact(&mut buf)?;
    Ok((status, String::from_utf8_lossy(&buf).into_owned()))
}

/// WebDriver's key for an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A ChromeDriver process and one headless Chromium session, ended on drop.
struct Browser {
    driver: Child,
    port: u16,
    session: String,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = webdriver(self.port, "DELETE", &format!("/session/{}", self.session), "");
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    fn start() -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let driver =
            Command::new("chromedriver").arg(format!("--port={port}")).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let t0 = Instant::now();
        while webdriver(port, "GET", "/status", "").is_err() {
            assert!(t0.elapsed() < Duration::from_secs(20), "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        let profile = tempfile::tempdir().unwrap();
        // The flags this machine's Chromium needs headless as root, with no network beyond
        // localhost (its background connections would be refused, many at a time).
        let args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            &format!("--user-data-dir={}", profile.path().display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome",
            "goog:chromeOptions": {"binary": "/usr/bin/chromium", "args": args}}}});
        let (st, body) = webdriver(port, "POST", "/session", &caps.to_string()).unwrap();
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(st, 200, "a browser session: {v}");
        let session = v["value"]["sessionId"].as_str().unwrap().to_string();
        Browser { driver, port, session, _profile: profile }
    }

    fn call(&self, method: &str, path: &str, body: Value) -> Value {
        let path = format!("/session/{}{path}", self.session);
        let (st, text) = webdriver(self.port, method, &path, &body.to_string()).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(st, 200, "{method} {path}: {v}");
        v["value"].clone()
    }

    fn open(&self, url: &str) {
        self.call("POST", "/url", json!({ "url": url }));
    }

    fn element(&self, css: &str) -> String {
        self.call("POST", "/element", json!({"using": "css selector", "value": css}))[ELEMENT].as_str().unwrap().to_string()
    }

    /// Types `text` into the element (`\u{E007}` is Enter).
    fn type_into(&self, css: &str, text: &str) {
        let e = self.element(css);
        self.call("POST", &format!("/element/{e}/value"), json!({ "text": text }));
    }

    fn click(&self, css: &str) {
        let e = self.element(css);
        self.call("POST", &format!("/element/{e}/click"), json!({}));
    }

    /// The page's value of a JavaScript expression.
    fn eval(&self, expr: &str) -> Value {
        self.call("POST", "/execute/sync", json!({"script": format!("return {expr};"), "args": []}))
    }

    /// Waits up to `secs` for `expr` to be truthy.
    fn wait_for(&self, expr: &str, secs: u64) -> Value {
        let t0 = Instant::now();
        loop {
            let v = self.eval(expr);
            if v.as_bool() == Some(true) || v.as_str().is_some_and(|s| !s.is_empty()) {
                return v;
            }
            assert!(t0.elapsed() < Duration::from_secs(secs), "timed out waiting for `{expr}`: {}", self.eval("document.body.innerText"));
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The last reply's text: its answer and its reasoning (folded away under a `details`).
const REPLY: &str = "(document.querySelector('.msg.assistant:last-child .content')?.textContent || '') + \
     (document.querySelector('.msg.assistant:last-child details.reasoning div')?.textContent || '')";

#[test]
#[cfg_attr(not(has_chromium), ignore = "Chromium and ChromeDriver are not installed: apt-get install chromium chromium-driver")]
fn the_chat_page_streams_a_reply_and_stops_one_mid_reply() {
    if Command::new("chromedriver").arg("--version").output().is_err() {
        common::skipped("Chromium and ChromeDriver are not installed (apt-get install chromium chromium-driver)", true);
        return;
    }
    // A long reply that takes seconds, so it can be stopped mid-way: a long context, and each
    // token slowed (the fixture may end a reply after a few hundred tokens, a fraction of a
    // second on an idle machine, before a click lands).
    let s = start_env(&["--context", "8192", "--default-max-tokens", "6000"], &[("DELTAFIN_FAULT_TOKEN_DELAY_MS", "20")]);
    let b = Browser::start();
    b.open(&format!("http://127.0.0.1:{}/", s.port));
    b.wait_for("document.getElementById('model').textContent.includes('checkpoint')", 10);
    // Type a message and press Enter: the reply streams in, then the stats line shows.
    b.click("#max");
    b.type_into("#max", "8");
    b.type_into("#input", "Hello there\u{E007}");
    b.wait_for("document.querySelector('.msg.user')?.textContent === 'Hello there'", 5);
    b.wait_for("document.getElementById('stats').textContent.includes('tokens')", 30);
    assert!(!b.eval(REPLY).as_str().unwrap().is_empty(), "a reply came back");
    // Reasoning, if any, is folded: shown only when opened.
    assert_eq!(b.eval("document.querySelector('.msg.assistant details.reasoning')?.open ?? false"), json!(false));
    assert!(b.eval("document.getElementById('stats').textContent").as_str().unwrap().contains("tok/s"));
    // A long reply (no max tokens): stop it once some text has arrived.
    b.call("POST", "/execute/sync", json!({"script": "document.getElementById('max').value = ''; return 0;", "args": []}));
    b.type_into("#input", "Tell me everything\u{E007}");
    b.wait_for(&format!("({REPLY}).length > 20"), 30);
    b.click("#stop");
    b.wait_for("document.querySelector('.msg.assistant:last-child .stopped') !== null", 5);
    let at_stop = b.eval(REPLY).as_str().unwrap().len();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(b.eval(REPLY).as_str().unwrap().len(), at_stop, "nothing arrives after Stop");
    assert_eq!(b.eval("document.getElementById('send').disabled"), json!(false), "ready for the next message");
    // The server cancelled the generation (the page closed the stream), well before 6000 tokens.
    let (_, _, metrics) = s.request("GET", "/metrics", None, &[]).unwrap();
    assert!(metrics.lines().any(|l| l.starts_with("deltafin_cancelled_total") && !l.ends_with(" 0")), "{metrics}");
}

#[test]
#[cfg_attr(not(has_chromium), ignore = "Chromium and ChromeDriver are not installed: apt-get install chromium chromium-driver")]
fn the_chat_page_asks_for_the_api_key_the_server_wants() {
    if Command::new("chromedriver").arg("--version").output().is_err() {
        common::skipped("Chromium and ChromeDriver are not installed (apt-get install chromium chromium-driver)", true);
        return;
    }
    let s = start(&["--api-key", "sesame"]);
    let b = Browser::start();
    b.open(&format!("http://127.0.0.1:{}/", s.port));
    b.wait_for("!document.getElementById('keybox').hidden", 10);
    b.type_into("#key", "sesame\u{E007}");
    b.wait_for("document.getElementById('keybox').hidden && document.getElementById('model').textContent.includes('checkpoint')", 10);
    b.click("#max");
    b.type_into("#max", "4");
    b.type_into("#input", "hi\u{E007}");
    b.wait_for("document.getElementById('stats').textContent.includes('tokens')", 30);
}
