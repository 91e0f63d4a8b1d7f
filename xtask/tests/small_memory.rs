//! Issue 2's memory rule: `run` on a generated `small` model peaks below its size on disk plus
//! 1 GB (no weight is held twice). Its own test binary, so the process measured is only this.

use deltafin_sched::{peak_rss_bytes, EngineBuilder, GenerateOptions};

#[test]
fn small_model_peak_memory_stays_below_disk_size_plus_1gb() {
    std::env::set_var("DELTAFIN_QUIET", "1");
    let tmp = tempfile::tempdir().unwrap();
    xtask::gen_k3::generate("small", 3, tmp.path()).unwrap();
    let disk: u64 = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    let model = EngineBuilder::new(tmp.path()).open().unwrap();
    let prompt = model.tokenizer().encode_ordinary("The history of the world is long");
    let mut seq = model.new_sequence();
    let mut n = 0;
    model
        .engine()
        .generate(&mut seq, &prompt, &GenerateOptions::new(8), |_| {
            n += 1;
            true
        })
        .unwrap();
    assert_eq!(n, 8);
    let peak = peak_rss_bytes();
    assert!(peak < disk + (1 << 30), "peak RSS {peak} vs disk {disk}");
    eprintln!("small model: {:.0} MB on disk, peak RSS {:.0} MB", disk as f64 / 1e6, peak as f64 / 1e6);
}
