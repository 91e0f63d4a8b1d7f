//! `deltafin-gpu-check`: on a machine with an NVIDIA GPU, proves the CUDA kernels give the CPU
//! kernels' bits and measures them against the GPU's own ceilings, from a prebuilt binary (the GPU
//! machine has no Rust toolchain).
//!
//! `deltafin-gpu-check [--bench] [--out FILE]`
//!
//! The check: random inputs and weights (BF16 at spine shapes, MXFP4 at K3's expert shapes, scales
//! down to the subnormal 2^-127), 1 to 600 token rows, every GPU value compared bit for bit with
//! `deltafin_core::dot_bf16` / `dot_mxfp4` on this CPU (all values of the smaller products, a
//! sample of the larger). Exit 1 on any difference.
//!
//! Then SiTU on the GPU (core's `exp`/`tanh`) against the CPU's over special, boundary and random
//! values, and whole experts through the CUDA backend against `Cpu::expert_forward`.
//!
//! `--bench`: each product against cuBLAS's FP32 SGEMM on the same shape (without TF32), and the
//! one-row products against the device's copy rate, alternated and timed with device events (the
//! median of 15 each), every ratio from this run. `--out` writes the table as Markdown.

mod backend_checks;

use std::fmt::Write as _;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::CudaStream;
use deltafin_core::{dot_bf16, dot_mxfp4, permute_for_mxfp4, Isa};
use deltafin_cuda::{Gpu, GpuWeights, LaneGemm, Workspace};
use rayon::prelude::*;

use deltafin_cuda::Values as Rng;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Bf16,
    Mxfp4,
}

struct Case {
    kind: Kind,
    tokens: usize,
    rows: usize,
    cols: usize,
}

struct Host {
    x: Vec<f32>,
    /// BF16 bytes, or MXFP4 codes.
    w: Vec<u8>,
    scales: Vec<u8>,
}

fn make(case: &Case, seed: u64, subnormal_scales: bool) -> Host {
    let mut rng = Rng(seed | 1);
    let x: Vec<f32> = (0..case.tokens * case.cols).map(|_| rng.unit()).collect();
    let (w, scales) = match case.kind {
        Kind::Bf16 => {
            let w = (0..case.rows * case.cols)
                .flat_map(|_| {
                    // Finite BF16 of exponents 2^-20 .. 2^3, either sign.
                    let e = 107 + (rng.bits() % 24) as u16;
                    let b = ((rng.bits() & 1) as u16) << 15 | e << 7 | (rng.bits() & 0x7f) as u16;
                    b.to_le_bytes()
                })
                .collect();
            (w, Vec::new())
        }
        Kind::Mxfp4 => {
            let w = (0..case.rows * case.cols / 2).map(|_| rng.bits() as u8).collect();
            let scales = (0..case.rows * case.cols / 32)
                .map(|_| if subnormal_scales { (rng.bits() % 6) as u8 } else { 112 + (rng.bits() % 24) as u8 })
                .collect();
            (w, scales)
        }
    };
    Host { x, w, scales }
}

fn upload(gpu: &Gpu, case: &Case, h: &Host) -> GpuWeights {
    match case.kind {
        Kind::Bf16 => gpu.upload_bf16(case.rows, case.cols, &h.w),
        Kind::Mxfp4 => gpu.upload_mxfp4(case.rows, case.cols, &h.w, &h.scales),
    }
    .unwrap_or_else(|e| fail(&format!("upload: {e}")))
}

/// The CPU's value of output (t, r).
fn cpu_value(isa: Isa, case: &Case, h: &Host, xp: &[Vec<f32>], t: usize, r: usize) -> f32 {
    let k = case.cols;
    match case.kind {
        Kind::Bf16 => dot_bf16(isa, &h.x[t * k..(t + 1) * k], &h.w[r * k * 2..(r + 1) * k * 2]),
        Kind::Mxfp4 => dot_mxfp4(isa, &xp[t], &h.w[r * k / 2..(r + 1) * k / 2], &h.scales[r * k / 32..(r + 1) * k / 32]),
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("deltafin-gpu-check: {msg}");
    std::process::exit(1)
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Checks one case with each lane GEMM; returns (values compared, values that differ).
fn check(gpu: &mut Gpu, isa: Isa, case: &Case, seed: u64, subnormal: bool) -> (usize, usize) {
    let (mut n, mut bad) = (0, 0);
    for variant in [LaneGemm::Vector, LaneGemm::Scalar] {
        gpu.lane_gemm = variant;
        let (a, b) = check_one(gpu, isa, case, seed, subnormal);
        n += a;
        bad += b;
    }
    gpu.lane_gemm = LaneGemm::default();
    (n, bad)
}

fn check_one(gpu: &Gpu, isa: Isa, case: &Case, seed: u64, subnormal: bool) -> (usize, usize) {
    let h = make(case, seed, subnormal);
    let w = upload(gpu, case, &h);
    let got = gpu.matmul_host(&h.x, case.tokens, &w).unwrap_or_else(|e| fail(&format!("matmul: {e}")));
    let xp: Vec<Vec<f32>> = match case.kind {
        Kind::Mxfp4 => (0..case.tokens).map(|t| permute_for_mxfp4(&h.x[t * case.cols..(t + 1) * case.cols])).collect(),
        Kind::Bf16 => Vec::new(),
    };
    let n = case.tokens * case.rows;
    // All values up to 2M of them, else a deterministic sample of 400k.
    let picks: Vec<usize> = if n <= 2_000_000 {
        (0..n).collect()
    } else {
        let mut rng = Rng(seed ^ 0x9e37_79b9);
        (0..400_000).map(|_| (rng.bits() % n as u64) as usize).collect()
    };
    let bad: Vec<(usize, f32, f32)> = picks
        .par_iter()
        .filter_map(|&i| {
            let want = cpu_value(isa, case, &h, &xp, i / case.rows, i % case.rows);
            (!same(got[i], want)).then_some((i, got[i], want))
        })
        .collect();
    for (i, g, w) in bad.iter().take(3) {
        eprintln!(
            "  value (t {}, r {}): GPU {g:e} ({:#010x}), CPU {w:e} ({:#010x})",
            i / case.rows,
            i % case.rows,
            g.to_bits(),
            w.to_bits()
        );
    }
    (picks.len(), bad.len())
}

fn label(case: &Case) -> String {
    format!("{} {} x [{}, {}]", if case.kind == Kind::Bf16 { "BF16" } else { "MXFP4" }, case.tokens, case.rows, case.cols)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bench = args.iter().any(|a| a == "--bench");
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let mut gpu = Gpu::open(0).unwrap_or_else(|e| fail(&e.to_string()));
    let isa = Isa::best();
    let mut report = String::new();
    let _ = writeln!(report, "GPU: {}  CPU reference: {:?}\n", gpu.name(), isa.kind());
    let _ = writeln!(report, "| bit-equality case | values compared | differing |\n|---|---|---|");
    let c = |kind, tokens, rows, cols| Case { kind, tokens, rows, cols };
    let cases = [
        (c(Kind::Bf16, 1, 4096, 7168), false),
        (c(Kind::Bf16, 3, 1000, 2048), false),
        (c(Kind::Bf16, 8, 512, 7168), false),
        (c(Kind::Bf16, 9, 777, 1040), false),
        (c(Kind::Bf16, 300, 700, 7168), false),
        (c(Kind::Bf16, 512, 7168, 7168), false),
        (c(Kind::Mxfp4, 1, 6144, 3584), false),
        (c(Kind::Mxfp4, 1, 3584, 3072), false),
        (c(Kind::Mxfp4, 5, 6144, 3584), false),
        (c(Kind::Mxfp4, 17, 500, 96), false),
        (c(Kind::Mxfp4, 256, 6144, 3584), false),
        (c(Kind::Mxfp4, 600, 3584, 3072), false),
        (c(Kind::Mxfp4, 1, 512, 3584), true),
        (c(Kind::Mxfp4, 40, 512, 3584), true),
    ];
    let mut total_bad = 0;
    for (i, (case, subnormal)) in cases.iter().enumerate() {
        let (n, bad) = check(&mut gpu, isa, case, 1000 + i as u64, *subnormal);
        total_bad += bad;
        let what = format!("{}{}", label(case), if *subnormal { " (scales to 2^-127)" } else { "" });
        let _ = writeln!(report, "| {what} | {n} | {bad} |");
        eprintln!("{what}: {n} values, {bad} differ");
    }
    let mut more = backend_checks::situ_check(&gpu);
    let backend = deltafin_cuda::CudaBackend::open(0, None).unwrap_or_else(|e| fail(&e.to_string()));
    more.extend(backend_checks::expert_check(&backend));
    for (what, n, bad) in more {
        total_bad += bad;
        let _ = writeln!(report, "| {what} | {n} | {bad} |");
        eprintln!("{what}: {n} values, {bad} differ");
    }
    drop(backend);
    if bench {
        report.push('\n');
        report.push_str(&benchmark(&mut gpu));
    }
    println!("{report}");
    if let Some(path) = out {
        std::fs::write(&path, &report).unwrap_or_else(|e| fail(&format!("{path}: {e}")));
    }
    if total_bad > 0 {
        fail(&format!("{total_bad} GPU values differ from the CPU's"));
    }
}

/// Milliseconds of `f` on the stream, by device events.
fn time_ms(stream: &std::sync::Arc<CudaStream>, f: &mut dyn FnMut()) -> f32 {
    let ctx = stream.context();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (a, b) = (ctx.new_event(flags).expect("event"), ctx.new_event(flags).expect("event"));
    a.record(stream).expect("record");
    f();
    b.record(stream).expect("record");
    b.synchronize().expect("sync");
    a.elapsed_ms(&b).expect("elapsed")
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

/// Ours (each lane GEMM) and cuBLAS's SGEMM on each shape, alternated; one-row products against
/// the copy rate.
fn benchmark(gpu: &mut Gpu) -> String {
    let stream = gpu.stream().clone();
    let blas = CudaBlas::new(stream.clone()).unwrap_or_else(|e| fail(&format!("cuBLAS: {e}")));
    let mut s = String::new();
    // The copy rate: 2 GiB device to device, bytes read plus written.
    let n = 1usize << 29;
    let src = stream.alloc_zeros::<f32>(n).expect("alloc");
    let mut dst = stream.alloc_zeros::<f32>(n).expect("alloc");
    let copy_ms = median((0..9).map(|_| time_ms(&stream, &mut || stream.memcpy_dtod(&src, &mut dst).expect("copy"))).collect());
    let copy_rate = 2.0 * (n * 4) as f64 / (copy_ms as f64 / 1e3);
    drop((src, dst));
    let _ = writeln!(s, "Device copy (2 GiB, read + write): {:.0} GB/s\n", copy_rate / 1e9);
    let _ = writeln!(
        s,
        "| product | ours (vector loads) | ours (scalar loads) | cuBLAS SGEMM (FP32) | best of ours / cuBLAS |\n|---|---|---|---|---|"
    );
    let c = |kind, tokens, rows, cols| Case { kind, tokens, rows, cols };
    for case in [
        c(Kind::Mxfp4, 256, 6144, 3584),
        c(Kind::Mxfp4, 512, 6144, 3584),
        c(Kind::Mxfp4, 2048, 6144, 3584),
        c(Kind::Mxfp4, 512, 3584, 3072),
        c(Kind::Bf16, 256, 7168, 7168),
        c(Kind::Bf16, 512, 7168, 7168),
        c(Kind::Bf16, 2048, 7168, 7168),
    ] {
        let h = make(&case, 7, false);
        let w = upload(gpu, &case, &h);
        let x = stream.clone_htod(&h.x).expect("upload");
        let mut out = stream.alloc_zeros::<f32>(case.tokens * case.rows).expect("alloc");
        let mut ws = Workspace::default();
        // cuBLAS on the same shape in F32 (weights widened: what an FP32 engine would multiply).
        let wf: Vec<f32> = (0..case.rows * case.cols).map(|i| (i % 97) as f32 / 97.0 - 0.5).collect();
        let wf = stream.clone_htod(&wf).expect("upload");
        let mut cf = stream.alloc_zeros::<f32>(case.tokens * case.rows).expect("alloc");
        let cfg = GemmConfig {
            transa: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
            transb: cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            m: case.rows as i32,
            n: case.tokens as i32,
            k: case.cols as i32,
            alpha: 1.0f32,
            lda: case.cols as i32,
            ldb: case.cols as i32,
            beta: 0.0f32,
            ldc: case.rows as i32,
        };
        let (mut vector, mut scalar, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..17 {
            gpu.lane_gemm = LaneGemm::Vector;
            let a = time_ms(&stream, &mut || gpu.matmul(&x.as_view(), case.tokens, &w, &mut out.as_view_mut(), &mut ws).expect("matmul"));
            gpu.lane_gemm = LaneGemm::Scalar;
            let c = time_ms(&stream, &mut || gpu.matmul(&x.as_view(), case.tokens, &w, &mut out.as_view_mut(), &mut ws).expect("matmul"));
            // SAFETY: the buffers hold the shapes the config names.
            let b = time_ms(&stream, &mut || unsafe { blas.gemm(cfg, &wf, &x, &mut cf) }.expect("sgemm"));
            if round >= 2 {
                vector.push(a);
                scalar.push(c);
                theirs.push(b);
            }
        }
        gpu.lane_gemm = LaneGemm::default();
        let flop = 2.0 * (case.tokens * case.rows * case.cols) as f64;
        let (a, c, b) = (median(vector) as f64 / 1e3, median(scalar) as f64 / 1e3, median(theirs) as f64 / 1e3);
        let tf = |secs: f64| flop / secs / 1e12;
        let _ = writeln!(
            s,
            "| {} | {:.1} TFLOP/s | {:.1} TFLOP/s | {:.1} TFLOP/s | {:.0}% |",
            label(&case),
            tf(a),
            tf(c),
            tf(b),
            100.0 * b / a.min(c)
        );
    }
    let _ = writeln!(s, "\n| one-row product | weight bytes | ours | of the copy rate |\n|---|---|---|---|");
    for case in
        [c(Kind::Mxfp4, 1, 16 * 6144, 3584), c(Kind::Mxfp4, 1, 3584, 3072), c(Kind::Bf16, 1, 163840, 7168), c(Kind::Bf16, 1, 7168, 7168)]
    {
        let h = make(&case, 9, false);
        let w = upload(gpu, &case, &h);
        let x = stream.clone_htod(&h.x).expect("upload");
        let mut out = stream.alloc_zeros::<f32>(case.rows).expect("alloc");
        let mut ws = Workspace::default();
        let ms = median(
            (0..17)
                .map(|_| time_ms(&stream, &mut || gpu.matmul(&x.as_view(), 1, &w, &mut out.as_view_mut(), &mut ws).expect("matmul")))
                .skip(2)
                .collect(),
        );
        let rate = w.bytes() as f64 / (ms as f64 / 1e3);
        let _ = writeln!(
            s,
            "| {} | {:.1} MB | {:.0} GB/s | {:.0}% |",
            label(&case),
            w.bytes() as f64 / 1e6,
            rate / 1e9,
            100.0 * rate / copy_rate
        );
    }
    s
}
