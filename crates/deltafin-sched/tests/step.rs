//! The engine step: slots sharing a step get the bits they get alone; a verify step cut back to
//! any prefix, or a failed step, leaves the state bit-identical to never having run it.

use std::path::{Path, PathBuf};

use deltafin_core::Mat;
use deltafin_sched::{EngineBuilder, LoadedModel, Phase, Sequence, Slot};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
}

fn bits(m: &Mat) -> Vec<u32> {
    m.data.iter().map(|v| v.to_bits()).collect()
}

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 101 + 5) % 1000).collect()
}

fn after(model: &LoadedModel, prompt: &[u32]) -> Sequence {
    let mut seq = model.new_sequence();
    model.engine().step(&mut [Slot::new(&mut seq, prompt, Phase::Prompt)], None).unwrap();
    seq
}

#[test]
fn slots_sharing_a_step_get_the_bits_they_get_alone() {
    let model = EngineBuilder::new(fixture()).open().unwrap();
    let (pa, pc) = (ids(7, 1), ids(12, 3));
    let work: [(Vec<u32>, Phase); 4] =
        [(vec![101], Phase::Decode), (ids(10, 2), Phase::Prompt), (ids(4, 4), Phase::Verify), (vec![7], Phase::Decode)];
    let starts = || vec![after(&model, &pa), model.new_sequence(), after(&model, &pc), after(&model, &ids(3, 9))];
    // Alone.
    let mut alone = starts();
    let mut want = Vec::new();
    for (seq, (new, phase)) in alone.iter_mut().zip(&work) {
        let out = model.engine().step(&mut [Slot::new(seq, new, *phase)], None).unwrap();
        want.push(bits(&out.logits[0]));
    }
    // Together, in one step.
    let mut together = starts();
    let mut slots: Vec<Slot> = together.iter_mut().zip(&work).map(|(seq, (new, phase))| Slot::new(seq, new, *phase)).collect();
    let out = model.engine().step(&mut slots, None).unwrap();
    drop(slots);
    assert_eq!(out.logits.len(), 4);
    for (i, l) in out.logits.iter().enumerate() {
        assert_eq!(bits(l), want[i], "slot {i}: logits differ beside other slots");
        assert_eq!(together[i].ids(), alone[i].ids());
        assert!(together[i].layer_states() == alone[i].layer_states(), "slot {i}: state differs beside other slots");
    }
    // The verify slot asked for every row, the others for the last.
    assert_eq!(out.logits[2].rows, 4);
    assert_eq!(out.logits[1].rows, 1);
}

#[test]
fn a_verify_step_cut_back_to_any_prefix_equals_never_running_it() {
    let model = EngineBuilder::new(fixture()).open().unwrap();
    let prompt = ids(9, 5);
    let drafts = ids(5, 6);
    for keep in 0..=drafts.len() {
        let mut a = after(&model, &prompt);
        model.engine().step(&mut [Slot::new(&mut a, &drafts, Phase::Verify)], None).unwrap();
        model.engine().rewind(&mut a, prompt.len() + keep).unwrap();
        let mut whole = prompt.clone();
        whole.extend_from_slice(&drafts[..keep]);
        let b = after(&model, &whole);
        assert_eq!(a.ids(), b.ids());
        assert!(a.layer_states() == b.layer_states(), "keep {keep}: state differs from a sequence that never saw the rest");
        // And the next step agrees bit for bit.
        let (mut a, mut b) = (a, b);
        let la = model.engine().step(&mut [Slot::new(&mut a, &[42], Phase::Decode)], None).unwrap();
        let lb = model.engine().step(&mut [Slot::new(&mut b, &[42], Phase::Decode)], None).unwrap();
        assert_eq!(bits(&la.logits[0]), bits(&lb.logits[0]), "keep {keep}");
    }
}

fn store_with_a_corrupt_last_layer(dir: &Path) -> PathBuf {
    let out = dir.join("store");
    deltafin_store::setup(&deltafin_store::SetupOptions::new(fixture(), &out), &deltafin_store::NoProgress).unwrap();
    let m = deltafin_store::Manifest::read(&out).unwrap();
    let last = m.layouts.iter().map(|(l, _)| *l).max().unwrap();
    for e in m.experts.iter().filter(|e| e.layer == last) {
        let c = &e.copies[0];
        let path = m.copy_path(c);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[c.offset as usize + 11] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
    }
    out
}

#[test]
fn a_failed_step_leaves_every_sequence_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let model = EngineBuilder::new(store_with_a_corrupt_last_layer(tmp.path())).open().unwrap();
    let mut seqs = vec![model.new_sequence(), model.new_sequence()];
    // The prompt's first layers run (a KDA and an MLA layer advance) before the last layer fails.
    for s in &mut seqs {
        let err = model.engine().step(&mut [Slot::new(s, &ids(6, 1), Phase::Prompt)], None).unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
    }
    let fresh = model.new_sequence();
    for s in &seqs {
        assert!(s.ids().is_empty() && s.layer_states() == fresh.layer_states());
    }
    let (a, b) = seqs.split_at_mut(1);
    let mut slots = [Slot::new(&mut a[0], &[3], Phase::Decode), Slot::new(&mut b[0], &[4, 5, 6], Phase::Prompt)];
    assert!(model.engine().step(&mut slots, None).is_err());
    for s in &seqs {
        assert!(s.ids().is_empty() && s.layer_states() == fresh.layer_states(), "a failed two-slot step left state behind");
    }
}

#[test]
fn a_verify_that_fails_mid_walk_leaves_the_sequence_as_it_was() {
    // A sequence holding a prompt (run on the healthy checkpoint) meets a store whose last layer
    // is corrupt: the verify step of four drafts fails after its first layers ran.
    let tmp = tempfile::tempdir().unwrap();
    let healthy = EngineBuilder::new(fixture()).open().unwrap();
    let broken = EngineBuilder::new(store_with_a_corrupt_last_layer(tmp.path())).open().unwrap();
    let before = after(&healthy, &ids(8, 3));
    let mut seq = before.clone();
    let err = broken.engine().step(&mut [Slot::new(&mut seq, &ids(5, 9), Phase::Verify)], None).unwrap_err();
    assert!(err.to_string().contains("checksum"), "{err}");
    assert_eq!(seq.ids(), before.ids());
    assert!(seq.layer_states() == before.layer_states(), "a failed verify left state behind");
    // And the sequence goes on exactly as one that never tried.
    let mut twin = before.clone();
    let a = healthy.engine().step(&mut [Slot::new(&mut seq, &[42], Phase::Decode)], None).unwrap();
    let b = healthy.engine().step(&mut [Slot::new(&mut twin, &[42], Phase::Decode)], None).unwrap();
    assert_eq!(bits(&a.logits[0]), bits(&b.logits[0]));
}

#[test]
fn every_backend_gives_the_same_bits() {
    use std::sync::Arc;
    let prompt = ids(11, 4);
    let mut want: Option<Vec<u32>> = None;
    for isa in deltafin_core::Isa::available() {
        let model = EngineBuilder::new(fixture()).backend(Arc::new(deltafin_core::Cpu::new(isa))).open().unwrap();
        assert_eq!(model.engine().model().backend().name(), format!("cpu-{:?}", isa.kind()).to_lowercase());
        let mut seq = model.new_sequence();
        let out = model.engine().step(&mut [Slot::new(&mut seq, &prompt, Phase::Verify)], None).unwrap();
        let got = bits(&out.logits[0]);
        match &want {
            None => want = Some(got),
            Some(w) => assert!(*w == got, "{isa:?} differs from the scalar reference"),
        }
    }
}

/// A copy of the fixture whose first MoE layer has every w1 scale byte at 255 (NaN in E8M0): a
/// checkpoint that is wrong the same way on every read, so no checksum can catch it.
fn checkpoint_with_nan_scales(dir: &Path) -> PathBuf {
    let out = dir.join("checkpoint");
    std::fs::create_dir(&out).unwrap();
    for f in std::fs::read_dir(fixture()).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, out.join(f.file_name().unwrap())).unwrap();
    }
    let mut hit = 0;
    for f in std::fs::read_dir(&out).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let mut bytes = std::fs::read(&f).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (name, t) in header.as_object().unwrap() {
            if name.contains("layers.1.block_sparse_moe.experts.") && name.ends_with("w1.weight_scale") {
                let at = t["data_offsets"].as_array().unwrap();
                let (a, b) = (at[0].as_u64().unwrap() as usize, at[1].as_u64().unwrap() as usize);
                bytes[8 + n + a..8 + n + b].fill(255);
                hit += 1;
            }
        }
        std::fs::write(&f, bytes).unwrap();
    }
    assert!(hit > 0, "no expert scales found in the fixture");
    out
}

#[test]
fn non_finite_logits_are_an_error_and_leave_the_sequence_as_it_was() {
    let tmp = tempfile::tempdir().unwrap();
    let healthy = EngineBuilder::new(fixture()).open().unwrap();
    let broken = EngineBuilder::new(checkpoint_with_nan_scales(tmp.path())).open().unwrap();
    let before = after(&healthy, &ids(5, 2));
    for (new, phase) in [(vec![9], Phase::Decode), (ids(4, 7), Phase::Verify), (ids(3, 1), Phase::Prompt)] {
        let mut seq = before.clone();
        let err = broken.engine().step(&mut [Slot::new(&mut seq, &new, phase)], None).unwrap_err();
        assert!(matches!(err, deltafin_sched::Error::NonFinite { .. }), "{phase:?}: {err}");
        assert!(err.to_string().contains("not finite"), "{err}");
        assert_eq!(seq.ids(), before.ids());
        assert!(seq.layer_states() == before.layer_states(), "{phase:?}: a step with NaN logits left state behind");
    }
}
