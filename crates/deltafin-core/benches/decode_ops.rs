//! What one MXFP4 group costs the AVX2 decode tile, in cycles of this CPU's FMA loop (x86-64
//! with AVX2 and FMA only; elsewhere it says so and stops).
//!
//! One group of one weight row is 32 weights: 12 vector operations decode them (3 byte
//! shuffles, 2 unpacks, 3 shifts, 4 ANDs and ORs; `decode_group_avx2`), 3 broadcast loads bring
//! its codes and its scale's two tables, and 4 fused multiply-adds use them. At the FMA peak a
//! group takes 2 cycles (64 FLOPs at 32 a cycle), so *of peak* = 2 / cycles.
//!
//! - *Mixes* run those instructions with no dependency between any two of them (each writes a
//!   register nothing reads; multiplies stand for the FMAs: the same pipes, no chain), so they
//!   measure what the CPU's pipes and scheduler allow the tile at best.
//!   The last mix moves the decode's two shifts onto the multiplier: what the pipes would allow
//!   a tile written that way.
//! - *Tiles* run `matmul_mxfp4` (the tile in assembly) and `matmul_mxfp4_without_assembly` (the
//!   compiler's) on one thread over 240 rows of K3's w1 width, which stay in L2.
//!
//! Times are the fastest of 40 runs, each beside the FMA loop's fastest (a cycle = the time of
//! two FMAs there), three rounds, the median round shown.
//!
//! `cargo bench -p deltafin-core --bench decode_ops`

#[cfg(target_arch = "x86_64")]
mod common;

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::run();
    #[cfg(not(target_arch = "x86_64"))]
    println!("decode_ops measures the AVX2 decode tile: not on this architecture");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::common::bytes;
    use deltafin_core::{matmul_mxfp4, matmul_mxfp4_without_assembly, permute_for_mxfp4, Isa, IsaKind, Mxfp4Matrix};
    use std::arch::asm;
    use std::hint::black_box;
    use std::time::Instant;

    /// A product of MXFP4 rows and inputs (`matmul_mxfp4` and its variant).
    type Matmul = fn(Isa, &[&[f32]], &Mxfp4Matrix, std::ops::Range<usize>, &mut [f32]);

    /// Passes of each mix's loop; each pass is 4 groups.
    const PASSES: usize = 5000;

    /// The fastest of 40 runs of `f`, in seconds.
    fn fastest(f: &mut dyn FnMut()) -> f64 {
        (0..40)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
    }

    /// Seconds of one cycle: 12 independent FMA chains, `PASSES * 4` steps (2 FMAs a cycle).
    fn cycle() -> f64 {
        let t = fastest(&mut || {
            // SAFETY: run only after AVX2 and FMA were detected.
            unsafe {
                asm!(
                    "2:",
                    ".rept 4",
                    "vfmadd231ps ymm0, ymm14, ymm15", "vfmadd231ps ymm1, ymm14, ymm15", "vfmadd231ps ymm2, ymm14, ymm15",
                    "vfmadd231ps ymm3, ymm14, ymm15", "vfmadd231ps ymm4, ymm14, ymm15", "vfmadd231ps ymm5, ymm14, ymm15",
                    "vfmadd231ps ymm6, ymm14, ymm15", "vfmadd231ps ymm7, ymm14, ymm15", "vfmadd231ps ymm8, ymm14, ymm15",
                    "vfmadd231ps ymm9, ymm14, ymm15", "vfmadd231ps ymm10, ymm14, ymm15", "vfmadd231ps ymm11, ymm14, ymm15",
                    ".endr",
                    "dec {n}", "jnz 2b",
                    n = inout(reg) PASSES => _,
                    out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
                    out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                    out("ymm14") _, out("ymm15") _, options(nostack, nomem),
                )
            }
        });
        t / (PASSES * 4 * 12 / 2) as f64
    }

    /// One group's decode: the 12 operations of `decode_group_avx2`, each result unread, the two
    /// 16-bit shifts of 32-bit words given (`shifts!` or, the same bits, `multiplies!`).
    macro_rules! decode {
        ($split:expr) => {
            concat!(
                "vpshufb ymm0, ymm14, ymm15\n",
                "vpsllw ymm1, ymm14, 4\n",
                "vpor ymm2, ymm14, ymm15\n",
                "vpand ymm3, ymm14, ymm15\n",
                "vpshufb ymm4, ymm14, ymm15\n",
                "vpshufb ymm5, ymm14, ymm15\n",
                "vpunpcklbw ymm6, ymm14, ymm15\n",
                "vpunpckhbw ymm7, ymm14, ymm15\n",
                "vpand ymm9, ymm14, ymm15\n",
                "vpand ymm11, ymm14, ymm15\n",
                $split,
            )
        };
    }
    /// The decode's two shifts, as `decode_group_avx2` does them.
    macro_rules! shifts {
        () => {
            "vpslld ymm8, ymm14, 16\nvpslld ymm10, ymm14, 16\n"
        };
    }
    /// The same two shifts as multiplies by 65536, which run on the multiplier instead of a
    /// shuffle pipe.
    macro_rules! multiplies {
        () => {
            "vpmulld ymm8, ymm14, ymm15\nvpmulld ymm10, ymm14, ymm15\n"
        };
    }
    /// Four multiplies in place of the group's FMAs.
    macro_rules! fmas {
        () => {
            "vmulps ymm12, ymm14, ymm15\nvmulps ymm13, ymm14, ymm15\nvmulps ymm12, ymm15, ymm14\nvmulps ymm13, ymm15, ymm14\n"
        };
    }
    /// The four FMAs reading their input from memory, as the tile's do.
    macro_rules! fmas_from_memory {
        () => {
            "vmulps ymm12, ymm14, ymmword ptr [{x}]\nvmulps ymm13, ymm14, ymmword ptr [{x} + 32]\nvmulps ymm12, ymm15, ymmword ptr [{x} + 64]\nvmulps ymm13, ymm15, ymmword ptr [{x} + 96]\n"
        };
    }
    /// The group's three broadcast loads (its codes and its scale's two tables).
    macro_rules! loads {
        () => {
            "vbroadcasti128 ymm0, xmmword ptr [{m}]\nvbroadcasti128 ymm4, xmmword ptr [{m} + 16]\nvbroadcasti128 ymm5, xmmword ptr [{m} + 32]\n"
        };
    }
    macro_rules! mix {
        ($name:ident, $($part:expr),+) => {
            /// Seconds for `PASSES` passes of 4 groups.
            fn $name(m: &[u8; 128]) -> f64 {
                fastest(&mut || {
                    // SAFETY: run only after AVX2 and FMA were detected; the loads stay in `m`.
                    unsafe {
                        asm!(
                            "2:", ".rept 4", $($part,)+ ".endr", "dec {n}", "jnz 2b",
                            n = inout(reg) PASSES => _, m = in(reg) m.as_ptr(), x = in(reg) m.as_ptr(),
                            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
                            out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _, options(nostack, readonly),
                        )
                    }
                })
            }
        };
    }
    mix!(decode_only, decode!(shifts!()), "/* {m} {x} */");
    mix!(fmas_only, fmas!(), "/* {m} {x} */");
    mix!(decode_and_fmas, decode!(shifts!()), fmas!(), "/* {m} {x} */");
    mix!(decode_fmas_and_loads, decode!(shifts!()), fmas!(), loads!(), "/* {x} */");
    mix!(decode_loads_and_fmas_from_memory, decode!(shifts!()), fmas_from_memory!(), loads!());
    mix!(multiplying_decode_loads_and_fmas, decode!(multiplies!()), fmas_from_memory!(), loads!());

    pub fn run() {
        let Some(isa) = Isa::new(IsaKind::Avx2) else {
            println!("decode_ops measures the AVX2 decode tile: this CPU has no AVX2 + FMA");
            return;
        };
        let m = [7u8; 128];
        let (rows, cols) = (240, 3584);
        let packed = bytes(rows * cols / 2, 3, 0, 255);
        let scales = bytes(rows * cols / 32, 5, 110, 30);
        let w = Mxfp4Matrix::new(rows, cols, &packed, &scales).expect("w1 width");
        let x = permute_for_mxfp4(&bytes(cols, 11, 0, 200).iter().map(|&b| b as f32 / 100.0 - 1.0).collect::<Vec<_>>());
        let tile = |f: Matmul| {
            let mut out = vec![0f32; rows];
            fastest(&mut || {
                f(isa, &[&x], &w, 0..rows, &mut out);
                black_box(&out);
            }) / (rows * cols / 32) as f64
        };
        let mut cases: [(&str, &mut dyn FnMut() -> f64); 8] = [
            ("mix: decode (12 ops)", &mut || decode_only(&m) / (4 * PASSES) as f64),
            ("mix: 4 FMAs", &mut || fmas_only(&m) / (4 * PASSES) as f64),
            ("mix: decode + 4 FMAs", &mut || decode_and_fmas(&m) / (4 * PASSES) as f64),
            ("mix: decode + 4 FMAs + 3 loads", &mut || decode_fmas_and_loads(&m) / (4 * PASSES) as f64),
            ("mix: decode + 3 loads + 4 FMAs reading the input", &mut || decode_loads_and_fmas_from_memory(&m) / (4 * PASSES) as f64),
            ("mix: the same, the decode's two 32-bit shifts as multiplies", &mut || {
                multiplying_decode_loads_and_fmas(&m) / (4 * PASSES) as f64
            }),
            ("tile in assembly (matmul_mxfp4)", &mut || tile(matmul_mxfp4)),
            ("compiled tile (matmul_mxfp4_without_assembly)", &mut || tile(matmul_mxfp4_without_assembly)),
        ];
        let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
        for _ in 0..3 {
            for (i, (_, case)) in cases.iter_mut().enumerate() {
                let c = cycle();
                rounds[i].push(case() / c);
            }
        }
        println!("| per group of 32 weights, one row | cycles (median of 3 rounds) | of FMA peak |");
        println!("|---|---|---|");
        for ((name, _), mut r) in cases.iter().zip(rounds) {
            r.sort_by(f64::total_cmp);
            println!("| {name} | {:.2} | {:.0}% |", r[1], 100.0 * 2.0 / r[1]);
        }
    }
}
