//! Every checkpoint error names what is wrong and where: missing, misshapen, mistyped or
//! truncated tensors, broken configs and missing files.

use std::path::{Path, PathBuf};

use deltafin_core::{K3Config, Model};
use deltafin_store::Checkpoint;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
}

fn copy() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    d
}

const SHARD1: &str = "model-00001-of-000004.safetensors";

/// Rewrites one shard's header with `f`, keeping the data bytes.
fn edit_header(dir: &Path, shard: &str, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let p = dir.join(shard);
    let bytes = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(h.as_object_mut().unwrap());
    let mut hb = serde_json::to_vec(&h).unwrap();
    while !hb.len().is_multiple_of(8) {
        hb.push(b' ');
    }
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend(hb);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&p, out).unwrap();
}

fn load_err(dir: &Path) -> String {
    match Checkpoint::open(dir) {
        Err(e) => e.to_string(),
        Ok(c) => match Model::load(c.config().clone(), &c) {
            Err(e) => e.to_string(),
            Ok(_) => match (1..c.config().num_layers).try_for_each(|l| c.expert_spans(l).map(|_| ())) {
                Err(e) => e.to_string(),
                Ok(()) => panic!("expected an error"),
            },
        },
    }
}

#[test]
fn the_fixture_loads() {
    let c = Checkpoint::open(&fixture()).unwrap();
    Model::load(c.config().clone(), &c).unwrap();
    let (layout, spans) = c.expert_spans(1).unwrap();
    assert_eq!(spans.len(), 32);
    assert_eq!(layout.offsets[0], 0, "w1 packed opens the span");
    assert!(spans.iter().all(|s| s.len == layout.span_len() as u64));
}

#[test]
fn missing_tensor_is_named() {
    let d = copy();
    let name = "language_model.model.layers.3.self_attn.q_a_layernorm.weight";
    edit_header(d.path(), SHARD1, |h| {
        let v = h.remove(name).unwrap();
        h.insert(format!("{name}.renamed"), v);
    });
    let e = load_err(d.path());
    assert!(e.contains(name) && e.contains("missing"), "{e}");
}

#[test]
fn wrong_shape_names_tensor_and_file() {
    let d = copy();
    let name = "language_model.model.layers.1.self_attn.q_proj.weight";
    edit_header(d.path(), SHARD1, |h| h[name]["shape"] = serde_json::json!([64, 256]));
    let e = load_err(d.path());
    assert!(e.contains(name) && e.contains(SHARD1) && e.contains("[64, 256]"), "{e}");
}

#[test]
fn wrong_dtype_names_tensor_and_file() {
    let d = copy();
    let name = "language_model.model.layers.1.self_attn.A_log";
    edit_header(d.path(), SHARD1, |h| {
        h[name]["dtype"] = "BF16".into();
        h[name]["shape"] = serde_json::json!([64]);
    });
    let e = load_err(d.path());
    assert!(e.contains(name) && e.contains(SHARD1) && e.contains("Bf16"), "{e}");
}

#[test]
fn expert_record_with_wrong_shape_is_named() {
    let d = copy();
    let name = "language_model.model.layers.1.block_sparse_moe.experts.5.w2.weight_scale";
    edit_header(d.path(), SHARD1, |h| h[name]["shape"] = serde_json::json!([3, 64]));
    let e = load_err(d.path());
    assert!(e.contains(name) && e.contains(SHARD1), "{e}");
}

#[test]
fn truncated_shard_names_tensor_and_file() {
    let d = copy();
    let p = d.path().join(SHARD1);
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 1000).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("truncated") && e.contains(SHARD1) && e.contains("tensor `language_model."), "{e}");
    // A file cut inside its header is also named.
    f.set_len(5).unwrap();
    let e = load_err(d.path());
    assert!(e.contains(SHARD1) && e.contains("truncated"), "{e}");
}

#[test]
fn missing_files_and_bad_config_are_named() {
    let d = copy();
    std::fs::remove_file(d.path().join("model-00002-of-000004.safetensors")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model-00002-of-000004.safetensors"), "{e}");
    let d = copy();
    let cfg = std::fs::read_to_string(d.path().join("config.json")).unwrap().replace("\"situ\"", "\"gelu\"");
    std::fs::write(d.path().join("config.json"), cfg).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("config.json") && e.contains("hidden_act") && e.contains("gelu"), "{e}");
    let e = load_err(Path::new("/nonexistent/model"));
    assert!(e.contains("/nonexistent/model/config.json"), "{e}");
    assert!(K3Config::from_json("{}").is_err());
}
