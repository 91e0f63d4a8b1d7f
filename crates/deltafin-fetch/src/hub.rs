//! A model repository on a hub: its configuration from the environment, the revision pinned to a
//! commit, and its file list with published hashes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::range::RetryPolicy;

/// Where the hub is and how to talk to it, from the hub's own environment conventions.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// `HF_ENDPOINT`, default `https://huggingface.co`.
    pub endpoint: String,
    /// `HF_TOKEN`, else the token file (`HF_TOKEN_PATH`, else `$HF_HOME/token`, else
    /// `~/.cache/huggingface/token`).
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE` set to 1/true/yes: nothing is fetched.
    pub offline: bool,
    /// Connections (requests in flight) at most: `DELTAFIN_HUB_CONNECTIONS`, default 8.
    pub connections: usize,
    /// A request whose body stops for this long is cut off and resumed.
    pub stall: Duration,
    pub retry: RetryPolicy,
}

impl HubConfig {
    /// The configuration the environment gives.
    pub fn from_env() -> HubConfig {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let token = var("HF_TOKEN").or_else(|| {
            let path = var("HF_TOKEN_PATH").map(PathBuf::from).unwrap_or_else(|| {
                let home = var("HF_HOME")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| PathBuf::from(var("HOME").unwrap_or_default()).join(".cache/huggingface"));
                home.join("token")
            });
            std::fs::read_to_string(path).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        HubConfig {
            endpoint: var("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into()).trim_end_matches('/').to_string(),
            token,
            offline,
            // Hubs throttle each connection: several keep-alive connections reach the link's rate.
            connections: var("DELTAFIN_HUB_CONNECTIONS").and_then(|v| v.parse().ok()).filter(|&n: &usize| n > 0).unwrap_or(8).min(64),
            stall: Duration::from_secs(30),
            retry: RetryPolicy::default(),
        }
    }
}

/// `hf://OWNER/REPO[@REVISION]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoRef {
    pub repo: String,
    pub revision: String,
}

impl RepoRef {
    /// Parses `hf://OWNER/REPO[@REV]` (revision default `main`).
    pub fn parse(s: &str) -> Result<RepoRef> {
        let rest = s
            .strip_prefix("hf://")
            .ok_or_else(|| Error::BadRef(format!("{s:?}: a hub model is written hf://OWNER/REPO or hf://OWNER/REPO@REVISION")))?;
        let (repo, revision) = rest.split_once('@').unwrap_or((rest, "main"));
        let parts: Vec<&str> = repo.split('/').collect();
        let ok = |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if parts.len() != 2 || !parts.iter().all(|p| ok(p)) || revision.is_empty() {
            return Err(Error::BadRef(format!("{s:?}: expected hf://OWNER/REPO[@REVISION]")));
        }
        Ok(RepoRef { repo: repo.to_string(), revision: revision.to_string() })
    }
}

/// A file of the repository as the hub lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteFile {
    pub path: String,
    pub size: u64,
    /// The LFS object's SHA-256 (hex) for large files.
    pub sha256: Option<String>,
    /// The git blob id (SHA-1 of `blob LEN\0` + content, hex) for files kept in git.
    pub git_oid: Option<String>,
}

/// How requests take turns: demand first, then prefetch, then background.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    Demand = 0,
    Prefetch = 1,
    Background = 2,
}

/// Request slots: at most `connections` in flight, a lower priority admitted only while no
/// higher one waits.
pub(crate) struct Gate {
    state: Mutex<(usize, [usize; 3])>,
    cv: Condvar,
    max: usize,
}

impl Gate {
    fn new(max: usize) -> Gate {
        Gate { state: Mutex::new((0, [0; 3])), cv: Condvar::new(), max: max.max(1) }
    }
    pub(crate) fn enter(&self, p: Priority) -> GateSlot<'_> {
        let mut st = self.state.lock().expect("poisoned");
        st.1[p as usize] += 1;
        while st.0 >= self.max || st.1[..p as usize].iter().any(|&w| w > 0) {
            st = self.cv.wait(st).expect("poisoned");
        }
        st.1[p as usize] -= 1;
        st.0 += 1;
        GateSlot(self)
    }
}

pub(crate) struct GateSlot<'a>(&'a Gate);

impl Drop for GateSlot<'_> {
    fn drop(&mut self) {
        self.0.state.lock().expect("poisoned").0 -= 1;
        self.0.cv.notify_all();
    }
}

/// How long a signed URL a redirect gave is reused at most (it is dropped sooner when refused).
pub(crate) const SIGNED_URL_TTL: Duration = Duration::from_secs(600);

/// One repository at one commit on a hub.
pub struct Hub {
    pub(crate) cfg: HubConfig,
    pub(crate) agent: ureq::Agent,
    pub(crate) repo: String,
    commit: String,
    /// Where each file's `resolve` URL redirected last, and when.
    pub(crate) signed: Mutex<HashMap<String, (String, Instant)>>,
    pub(crate) gate: Gate,
}

impl Hub {
    /// Connects to `r.repo` and pins `r.revision` to its commit id (a 40-hex revision is taken as
    /// a commit as it is, so a pinned store never asks the hub again).
    pub fn open(cfg: HubConfig, r: &RepoRef) -> Result<Hub> {
        let agent = ureq::AgentBuilder::new()
            .redirects(0)
            .timeout_connect(Duration::from_secs(15))
            .timeout_read(cfg.stall)
            .max_idle_connections_per_host(cfg.connections)
            .user_agent(concat!("deltafin/", env!("CARGO_PKG_VERSION")))
            .build();
        let mut hub = Hub {
            gate: Gate::new(cfg.connections),
            cfg,
            agent,
            repo: r.repo.clone(),
            commit: String::new(),
            signed: Mutex::new(HashMap::new()),
        };
        hub.commit = if r.revision.len() == 40 && r.revision.chars().all(|c| c.is_ascii_hexdigit()) {
            r.revision.to_ascii_lowercase()
        } else {
            hub.resolve_revision(&r.revision)?
        };
        Ok(hub)
    }

    /// The commit id every request reads from.
    pub fn commit(&self) -> &str {
        &self.commit
    }

    /// The repository, `OWNER/REPO`.
    pub fn repo(&self) -> &str {
        &self.repo
    }

    /// Requests this hub keeps in flight at most (one connection each).
    pub fn connections(&self) -> usize {
        self.cfg.connections
    }

    /// Whether nothing may be fetched.
    pub fn offline(&self) -> bool {
        self.cfg.offline
    }

    fn offline_error(&self, what: &str) -> Error {
        Error::Offline { what: what.into() }
    }

    /// GET of a small JSON document, with the retry policy.
    fn get_json(&self, url: &str) -> Result<(serde_json::Value, Option<String>)> {
        let _slot = self.gate.enter(Priority::Demand);
        self.with_retries(url, |attempt| {
            let _ = attempt;
            let mut req = self.agent.get(url);
            if let Some(t) = &self.cfg.token {
                req = req.set("Authorization", &format!("Bearer {t}"));
            }
            let resp = crate::range::call(req, url)?;
            let next = resp.header("Link").and_then(next_link);
            let text = resp.into_string().map_err(|e| crate::range::Attempt::Retry(format!("reading the body: {e}"), None))?;
            let v = serde_json::from_str(&text)
                .map_err(|e| crate::range::Attempt::Fail(Error::Protocol { url: url.into(), why: format!("not JSON: {e}") }))?;
            Ok((v, next))
        })
    }

    fn resolve_revision(&self, revision: &str) -> Result<String> {
        if self.cfg.offline {
            return Err(self.offline_error(&format!("revision {revision} of {}", self.repo)));
        }
        let url = format!("{}/api/models/{}/revision/{}", self.cfg.endpoint, self.repo, revision);
        let (v, _) = self.get_json(&url)?;
        v.get("sha")
            .and_then(|s| s.as_str())
            .filter(|s| s.len() == 40)
            .map(str::to_string)
            .ok_or_else(|| Error::Protocol { url, why: "no 40-hex `sha` in the revision info".into() })
    }

    /// Every file of the repository at the pinned commit, with sizes and published hashes.
    pub fn list_files(&self) -> Result<Vec<RemoteFile>> {
        if self.cfg.offline {
            return Err(self.offline_error(&format!("the file list of {}", self.repo)));
        }
        let mut url = format!("{}/api/models/{}/tree/{}?recursive=true", self.cfg.endpoint, self.repo, self.commit);
        let mut files = Vec::new();
        loop {
            let (v, next) = self.get_json(&url)?;
            let items = v.as_array().ok_or_else(|| Error::Protocol { url: url.clone(), why: "the tree is not a JSON array".into() })?;
            for it in items {
                if it.get("type").and_then(|t| t.as_str()) != Some("file") {
                    continue;
                }
                let s = |k: &str| it.get(k).and_then(|x| x.as_str()).map(str::to_string);
                let path = s("path").ok_or_else(|| Error::Protocol { url: url.clone(), why: "a tree entry without `path`".into() })?;
                let lfs = it.get("lfs");
                let size = lfs.and_then(|l| l.get("size")).or(it.get("size")).and_then(|x| x.as_u64()).unwrap_or(0);
                let sha256 = lfs.and_then(|l| l.get("oid").or(l.get("sha256"))).and_then(|x| x.as_str()).map(str::to_string);
                let git_oid = if sha256.is_none() { s("oid") } else { None };
                files.push(RemoteFile { path, size, sha256, git_oid });
            }
            match next {
                Some(n) => url = n,
                None => break,
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(files)
    }

    /// The `resolve` URL of `file` at the pinned commit.
    pub(crate) fn resolve_url(&self, file: &str) -> String {
        format!("{}/{}/resolve/{}/{}", self.cfg.endpoint, self.repo, self.commit, file)
    }
}

/// The `rel="next"` target of a `Link` header (the hub pages long trees).
fn next_link(h: &str) -> Option<String> {
    h.split(',').find(|p| p.contains("rel=\"next\"")).and_then(|p| Some(p[p.find('<')? + 1..p.find('>')?].to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_refs_parse_or_say_what_is_expected() {
        assert_eq!(
            RepoRef::parse("hf://moonshotai/Kimi-K3").unwrap(),
            RepoRef { repo: "moonshotai/Kimi-K3".into(), revision: "main".into() }
        );
        assert_eq!(RepoRef::parse("hf://a/b@v1.0").unwrap().revision, "v1.0");
        for bad in ["moonshotai/Kimi-K3", "hf://onlyone", "hf://a/b/c", "hf://a/b@", "hf://a b/c"] {
            assert!(RepoRef::parse(bad).unwrap_err().to_string().contains("hf://OWNER/REPO"), "{bad}");
        }
    }

    #[test]
    fn link_headers_page_on() {
        assert_eq!(next_link("<https://h/api?cursor=x>; rel=\"next\"").as_deref(), Some("https://h/api?cursor=x"));
        assert_eq!(next_link("<https://h/a>; rel=\"prev\""), None);
    }
}
