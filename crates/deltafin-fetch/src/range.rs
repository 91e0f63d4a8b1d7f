//! One byte range of one file, exactly: redirects followed by hand (the signed URL they end at
//! is reused until it expires or is refused), retries with backoff and jitter, `Retry-After`
//! honoured, a body that stops resumed where it stopped, and nothing accepted but a `206` whose
//! `Content-Range` and length are the ones asked for, or a `200` with the whole file (RFC 9110
//! lets a server ignore `Range`) read up to the range and through it when the range starts within
//! [`IGNORED_RANGE_SKIP_MAX`] bytes; further in, such a server is refused with an error that says
//! so. Callers check what they fetched against the hub's hashes either way.

use std::hash::{BuildHasher, Hasher};
use std::io::Read;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::hub::{Hub, Priority};

/// The smallest part [`Hub::fetch_range_split`] makes: below it a request's round trip costs
/// more than the throttle saves.
pub const SPLIT_MIN: usize = 1 << 20;

/// From a server that ignores `Range`, at most this many bytes before the range are read and
/// dropped to reach it (a resumed small file, a header); an expert deep in a shard is refused.
pub const IGNORED_RANGE_SKIP_MAX: u64 = 64 << 20;

/// How hard to try.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// Failed attempts before giving up (attempts that made progress are not counted).
    pub attempts: u32,
    /// First back-off; doubled per failure, with jitter.
    pub base: Duration,
    /// Longest wait, including a `Retry-After`.
    pub max_wait: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { attempts: 8, base: Duration::from_millis(250), max_wait: Duration::from_secs(60) }
    }
}

/// Why one attempt failed.
pub(crate) enum Attempt {
    /// Worth another try (after the hub's `Retry-After`, if it gave one).
    Retry(String, Option<Duration>),
    /// Try again at once (a redirect was taken, a signed URL expired).
    Again,
    /// The body stopped after some bytes arrived: ask for the rest at once.
    Resume,
    /// Final.
    Fail(Error),
}

/// Sends `req`, sorting failures into retryable and final.
pub(crate) fn call(req: ureq::Request, url: &str) -> std::result::Result<ureq::Response, Attempt> {
    match req.call() {
        Ok(r) => Ok(r),
        Err(ureq::Error::Status(code, r)) => {
            if code == 429 || code == 408 || code >= 500 {
                let after = r.header("Retry-After").and_then(|v| v.trim().parse::<u64>().ok()).map(Duration::from_secs);
                Err(Attempt::Retry(format!("the hub answered {code}"), after))
            } else {
                Err(Attempt::Fail(Error::Status { url: url.into(), status: code }))
            }
        }
        Err(ureq::Error::Transport(t)) => Err(Attempt::Retry(t.to_string(), None)),
    }
}

/// A random factor in [0.5, 1.5) for back-off jitter.
fn jitter() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    0.5 + (h.finish() % 10_000) as f64 / 10_000.0
}

/// `loc` made absolute against `base`.
fn absolute(base: &str, loc: &str) -> String {
    if loc.starts_with("http://") || loc.starts_with("https://") {
        return loc.to_string();
    }
    let origin_end = base.find("://").map_or(0, |i| i + 3);
    let host_end = base[origin_end..].find('/').map_or(base.len(), |i| origin_end + i);
    format!("{}{}", &base[..host_end], if loc.starts_with('/') { loc.to_string() } else { format!("/{loc}") })
}

impl Hub {
    /// Runs `f` until it succeeds, fails for good, or the retry policy runs out.
    pub(crate) fn with_retries<T>(&self, url: &str, mut f: impl FnMut(u32) -> std::result::Result<T, Attempt>) -> Result<T> {
        let policy = self.cfg.retry;
        let (mut failures, mut hops) = (0u32, 0u32);
        loop {
            match f(failures) {
                Ok(v) => return Ok(v),
                Err(Attempt::Fail(e)) => return Err(e),
                Err(Attempt::Resume) => {}
                Err(Attempt::Again) => {
                    hops += 1;
                    if hops > 10 {
                        return Err(Error::Protocol {
                            url: url.into(),
                            why: "more than 10 redirects or refused signed URLs in a row".into(),
                        });
                    }
                }
                Err(Attempt::Retry(why, after)) => {
                    failures += 1;
                    if failures >= policy.attempts {
                        return Err(Error::GaveUp { url: url.into(), attempts: failures, last: why });
                    }
                    let backoff = policy.base.mul_f64(2f64.powi(failures as i32 - 1) * jitter());
                    std::thread::sleep(after.unwrap_or(backoff).min(policy.max_wait));
                }
            }
        }
    }

    /// Where to send a request for `file` now: its cached signed URL while fresh, else `resolve`.
    fn target(&self, file: &str) -> String {
        let signed = self.signed.lock().expect("poisoned");
        match signed.get(file) {
            Some((url, at)) if at.elapsed() < crate::hub::SIGNED_URL_TTL => url.clone(),
            _ => self.resolve_url(file),
        }
    }

    /// Reads `buf.len()` bytes of `file` from `offset` as up to `connections()` ranges of at
    /// least [`SPLIT_MIN`] bytes fetched side by side. Hubs throttle each connection, so one
    /// expert the engine waits for arrives several times sooner split than whole; the first
    /// error is returned once every part has ended.
    pub fn fetch_range_split(&self, file: &str, offset: u64, buf: &mut [u8], priority: Priority) -> Result<()> {
        let parts = (buf.len() / SPLIT_MIN).clamp(1, self.connections());
        if parts == 1 {
            return self.fetch_range(file, offset, buf, priority);
        }
        let each = buf.len().div_ceil(parts);
        std::thread::scope(|scope| {
            let handles: Vec<_> = buf
                .chunks_mut(each)
                .enumerate()
                .map(|(i, part)| scope.spawn(move || self.fetch_range(file, offset + (i * each) as u64, part, priority)))
                .collect();
            handles.into_iter().map(|h| h.join().expect("a range fetch panicked")).collect::<Vec<_>>().into_iter().collect()
        })
    }

    /// Reads `buf.len()` bytes of `file` from `offset`, exactly (see the module doc).
    pub fn fetch_range(&self, file: &str, offset: u64, buf: &mut [u8], priority: Priority) -> Result<()> {
        self.fetch_range_parts(file, offset, vec![buf], priority, &mut |_, _| {})
    }

    /// Reads `file` from `offset` into `parts`, consecutive buffers filled in order by one range
    /// request, handing each part to `done` (with its index) the moment its last byte arrives, so
    /// a caller can store one part while the rest of the body is still streaming in. A retry
    /// resumes after the last byte received, so a part handed over is never written again.
    pub fn fetch_range_parts<B: AsMut<[u8]>>(
        &self,
        file: &str,
        offset: u64,
        mut parts: Vec<B>,
        priority: Priority,
        done: &mut dyn FnMut(usize, B),
    ) -> Result<()> {
        let total: usize = parts.iter_mut().map(|p| p.as_mut().len()).sum();
        if self.cfg.offline {
            return Err(Error::Offline { what: format!("{total} bytes of {file} at {offset}") });
        }
        // Parts still (partly) empty, the front one last, with the index each had in `parts`.
        parts.reverse();
        let mut pending: Vec<(usize, B)> = (0..parts.len()).rev().zip(parts).collect();
        // Bytes received into the front part.
        let mut in_part = 0usize;
        let mut hand_over = |pending: &mut Vec<(usize, B)>, in_part: &mut usize| {
            while pending.last_mut().is_some_and(|(_, p)| *in_part == p.as_mut().len()) {
                let (i, p) = pending.pop().expect("checked");
                done(i, p);
                *in_part = 0;
            }
        };
        hand_over(&mut pending, &mut in_part);
        if total == 0 {
            return Ok(());
        }
        let _slot = self.gate.enter(priority);
        let resolve = self.resolve_url(file);
        let mut got = 0usize;
        let mut progress_retries = 0u32;
        self.with_retries(&resolve, |_| {
            let url = self.target(file);
            let (start, end) = (offset + got as u64, offset + total as u64 - 1);
            let mut req = self.agent.get(&url).set("Range", &format!("bytes={start}-{end}"));
            if let (Some(t), true) = (&self.cfg.token, url.starts_with(&self.cfg.endpoint)) {
                // The token goes to the hub only, never to the storage a redirect points at.
                req = req.set("Authorization", &format!("Bearer {t}"));
            }
            let signed = url != resolve;
            let resp = match call(req, &url) {
                Err(Attempt::Fail(Error::Status { status: 401 | 403 | 404 | 410, .. })) if signed => {
                    // An expired or refused signed URL: ask `resolve` for a new one.
                    self.signed.lock().expect("poisoned").remove(file);
                    return Err(Attempt::Again);
                }
                r => r?,
            };
            let status = resp.status();
            if (300..400).contains(&status) {
                let loc = resp
                    .header("Location")
                    .ok_or_else(|| Attempt::Fail(Error::Protocol { url: url.clone(), why: format!("a {status} without Location") }))?;
                self.signed.lock().expect("poisoned").insert(file.to_string(), (absolute(&url, loc), Instant::now()));
                return Err(Attempt::Again);
            }
            let want_len = end - start + 1;
            let length = resp.header("Content-Length").map(|v| v.trim().parse::<u64>());
            // Bytes of the body before the range: none in a 206, `start` in a whole file.
            let skip = match status {
                206 => {
                    let want_range = format!("bytes {start}-{end}/");
                    match resp.header("Content-Range") {
                        Some(cr) if cr.starts_with(&want_range) => {}
                        other => return Err(Attempt::Retry(format!("{url}: Content-Range {other:?}, asked for {want_range}*"), None)),
                    }
                    match length {
                        Some(Ok(n)) if n == want_len => {}
                        None => {}
                        other => return Err(Attempt::Retry(format!("{url}: Content-Length {other:?}, asked for {want_len}"), None)),
                    }
                    0
                }
                200 => {
                    if start > IGNORED_RANGE_SKIP_MAX {
                        return Err(Attempt::Fail(Error::Protocol {
                            url: url.clone(),
                            why: format!(
                                "this server ignores Range requests (it answered 200 with the whole file to `bytes={start}-{end}`), \
                                 and reading {start} bytes to reach the range for every expert is not workable: stream from a hub \
                                 that honours Range (HF_ENDPOINT), or download the checkpoint and use `setup --full`"
                            ),
                        }));
                    }
                    match length {
                        Some(Ok(n)) if n > end => {}
                        None => {}
                        other => {
                            return Err(Attempt::Retry(
                                format!("{url}: a whole-file 200 of Content-Length {other:?} cannot hold bytes {start}-{end}"),
                                None,
                            ))
                        }
                    }
                    start
                }
                _ => return Err(Attempt::Retry(format!("{url} answered {status} to a range request, not 206"), None)),
            };
            let mut body = resp.into_reader();
            if skip > 0 {
                let skipped = std::io::copy(&mut (&mut body).take(skip), &mut std::io::sink()).unwrap_or(0);
                if skipped < skip {
                    return Err(Attempt::Retry(
                        format!("{url}: a whole-file 200 ended after {skipped} bytes, before the range at {start}"),
                        None,
                    ));
                }
            }
            let before = got;
            let mut cut = None;
            while got < total {
                let (_, part) = pending.last_mut().expect("bytes remain, so a part does");
                match body.read(&mut part.as_mut()[in_part..]) {
                    Ok(0) => break,
                    Ok(n) => {
                        got += n;
                        in_part += n;
                        hand_over(&mut pending, &mut in_part);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        cut = Some(e.to_string());
                        break;
                    }
                }
            }
            if got == total {
                return Ok(());
            }
            let why =
                format!("{url}: the body stopped after {} of {want_len} bytes ({})", got - before, cut.as_deref().unwrap_or("closed"));
            if got > before {
                // A drop or a stall after progress: ask for the rest at once (bounded, so a
                // link that trickles forever still ends).
                progress_retries += 1;
                if progress_retries <= 4 * self.cfg.retry.attempts {
                    return Err(Attempt::Resume);
                }
                return Err(Attempt::Fail(Error::GaveUp { url: url.clone(), attempts: progress_retries, last: why }));
            }
            Err(Attempt::Retry(why, None))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_targets_become_absolute() {
        assert_eq!(absolute("http://h:1/a/b", "/c?x=1"), "http://h:1/c?x=1");
        assert_eq!(absolute("http://h:1/a/b", "https://cdn/z"), "https://cdn/z");
        assert_eq!(absolute("http://h", "c"), "http://h/c");
    }

    #[test]
    fn jitter_stays_in_its_band() {
        for _ in 0..100 {
            let j = jitter();
            assert!((0.5..1.5).contains(&j));
        }
    }
}
