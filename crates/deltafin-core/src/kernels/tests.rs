//! Kernels: every SIMD path equals the scalar reference bit for bit, and the scalar reference
//! equals an independent f64 computation to rounding.

use super::*;
use crate::tensor::Mat;
use crate::weights::{Bf16Matrix, Bytes};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() % 20001) as f32 / 10000.0 - 1.0
    }
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect()
}

#[test]
fn bf16_and_f32_dots_agree_across_isas_bitwise() {
    let mut rng = Rng(7);
    for n in [1usize, 15, 16, 17, 64, 100, 7168] {
        let x: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
        let w: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
        let wb = bf16_bytes(&w);
        let reference = dot_bf16(Isa::SCALAR, &x, &wb);
        let exact: f64 = x
            .iter()
            .zip(&wb.chunks(2).collect::<Vec<_>>())
            .map(|(a, b)| *a as f64 * crate::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64)
            .sum();
        assert!((reference as f64 - exact).abs() < 1e-4 * (n as f64).sqrt(), "n={n}");
        let rf = dot_f32(Isa::SCALAR, &x, &w);
        for isa in Isa::available() {
            assert_eq!(dot_bf16(isa, &x, &wb).to_bits(), reference.to_bits(), "{isa:?} n={n}");
            assert_eq!(dot_f32(isa, &x, &w).to_bits(), rf.to_bits(), "{isa:?} n={n}");
        }
    }
}

#[test]
fn mxfp4_dot_matches_dequantized_reference_and_isas() {
    let mut rng = Rng(99);
    for cols in [32usize, 64, 3584] {
        let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
        let packed: Vec<u8> = (0..cols / 2).map(|_| rng.next() as u8).collect();
        let scales: Vec<u8> = (0..cols / 32).map(|_| 110 + (rng.next() % 30) as u8).collect();
        // Independent dequantization: column c of group g, low nibble = even column.
        let w: Vec<f64> = (0..cols)
            .map(|c| {
                let b = packed[c / 2];
                let code = if c % 2 == 0 { b & 15 } else { b >> 4 };
                e2m1_value(code) as f64 * 2f64.powi(scales[c / 32] as i32 - 127)
            })
            .collect();
        let exact: f64 = x.iter().zip(&w).map(|(a, b)| *a as f64 * b).sum();
        let xp = permute_for_mxfp4(&x);
        let reference = dot_mxfp4(Isa::SCALAR, &xp, &packed, &scales);
        assert!((reference as f64 - exact).abs() <= 1e-5 * exact.abs().max(1.0), "cols={cols}: {reference} vs {exact}");
        for isa in Isa::available() {
            assert_eq!(dot_mxfp4(isa, &xp, &packed, &scales).to_bits(), reference.to_bits(), "{isa:?}");
        }
    }
}

#[test]
fn one_row_against_many_inputs_equals_each_dot_alone_bitwise() {
    let mut rng = Rng(5);
    let cols = 320;
    let packed: Vec<u8> = (0..cols / 2).map(|_| rng.next() as u8).collect();
    let scales: Vec<u8> = (0..cols / 32).map(|_| 100 + (rng.next() % 50) as u8).collect();
    let xs: Vec<Vec<f32>> = (0..19).map(|_| permute_for_mxfp4(&(0..cols).map(|_| rng.f32()).collect::<Vec<_>>())).collect();
    // Input counts around the SIMD paths' blocks of 4 and 8.
    for n in [1usize, 3, 4, 5, 8, 9, 19] {
        let refs: Vec<&[f32]> = xs[..n].iter().map(|x| &x[..]).collect();
        for isa in Isa::available() {
            let mut out = vec![0f32; n];
            dot_mxfp4_inputs(isa, &refs, &packed, &scales, &mut out);
            for (t, x) in refs.iter().enumerate() {
                assert_eq!(out[t].to_bits(), dot_mxfp4(Isa::SCALAR, x, &packed, &scales).to_bits(), "{isa:?}, {n} inputs, input {t}");
            }
        }
    }
}

#[test]
fn every_scale_byte_and_code_decodes_as_the_scalar_table() {
    // One row per scale byte, each group one code repeated (all 16 codes), so every decode
    // table entry is read; the input is nonzero at one column of each group, so a value sums
    // one weight per group. From scale 253 the largest codes overflow to infinity and zero times
    // infinity is NaN: there the paths must agree on NaN, not on its payload.
    let cols = 16 * 32;
    let packed: Vec<u8> = (0..256 * cols / 2).map(|i| (i / 16 % 16 * 17) as u8).collect();
    let scales: Vec<u8> = (0..256 * cols / 32).map(|i| (i / 16) as u8).collect();
    let w = Mxfp4Matrix::new(256, cols, &packed, &scales).unwrap();
    for column in [0, 1, 17, 30] {
        let x = permute_for_mxfp4(&(0..cols).map(|c| if c % 32 == column { 1.0 + c as f32 / 64.0 } else { 0.0 }).collect::<Vec<_>>());
        let mut reference = vec![0f32; 256];
        matmul_mxfp4(Isa::SCALAR, &[&x], &w, 0..256, &mut reference);
        for isa in Isa::available() {
            let mut out = vec![0f32; 256];
            matmul_mxfp4(isa, &[&x], &w, 0..256, &mut out);
            for (s, (o, r)) in out.iter().zip(&reference).enumerate() {
                assert!(
                    o.to_bits() == r.to_bits() || (s >= 253 && o.is_nan() && r.is_nan()),
                    "{isa:?}, scale {s}, column {column}: {o} against {r}"
                );
            }
        }
    }
}

#[test]
fn the_decode_tile_in_assembly_equals_the_lone_dots_bitwise() {
    // One input against 10 rows (three tiles of 3 and a tail) at widths that leave every
    // remainder of the assembly's 4-group passes, and past 128 groups, where a decode's product
    // is cut into K blocks (the second one short of a pass, or one pass and a remainder).
    let mut rng = Rng(33);
    let rows = 10;
    for groups in [1usize, 3, 4, 5, 8, 11, 131, 135] {
        let cols = 32 * groups;
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
        let scales: Vec<u8> = (0..rows * groups).map(|i| if i % 11 == 0 { (i % 3) as u8 } else { 90 + (rng.next() % 70) as u8 }).collect();
        let w = Mxfp4Matrix::new(rows, cols, &packed, &scales).unwrap();
        let x = permute_for_mxfp4(&(0..cols).map(|_| rng.f32()).collect::<Vec<_>>());
        let lone: Vec<u32> = (0..rows)
            .map(|r| {
                let (p, s) = w.row_bytes(r);
                dot_mxfp4(Isa::SCALAR, &x, p, s).to_bits()
            })
            .collect();
        for isa in Isa::available() {
            for (name, matmul) in [("assembly", matmul_mxfp4 as fn(_, &_, &_, _, &mut _)), ("compiled", matmul_mxfp4_without_assembly)] {
                let mut out = vec![f32::NAN; rows];
                matmul(isa, &[&x], &w, 0..rows, &mut out);
                let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(bits, lone, "{isa:?}, {name}, {groups} groups");
            }
        }
    }
}

#[test]
fn mxfp4_tiles_equal_each_lone_dot_bitwise() {
    let mut rng = Rng(21);
    // 23 rows leave tails after tiles of 8, 6, 4, 3 and 2 rows; 1312 columns are 41 groups, cut
    // into K blocks of 32 groups (4 inputs), 42 (3) or more, with a partial last block.
    let (rows, cols) = (23, 1312);
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
    // Scale bytes 0 and 1 make subnormal weights; the rest are spread over ordinary scales.
    let scales: Vec<u8> = (0..rows * cols / 32).map(|i| if i % 7 == 0 { (i % 2) as u8 } else { 100 + (rng.next() % 50) as u8 }).collect();
    let w = Mxfp4Matrix::new(rows, cols, &packed, &scales).unwrap();
    let xs: Vec<Vec<f32>> = (0..36).map(|_| permute_for_mxfp4(&(0..cols).map(|_| rng.f32()).collect::<Vec<_>>())).collect();
    let lone = |x: &[f32], r: usize| {
        let (p, s) = w.row_bytes(r);
        dot_mxfp4(Isa::SCALAR, x, p, s)
    };
    // The same inputs on cache lines, which the panels read in place instead of copying.
    let mut lined = LinedRows::new(xs.len(), cols);
    for (i, x) in xs.iter().enumerate() {
        lined.row_mut(i).copy_from_slice(x);
    }
    // Input counts: every tile width, its tails, and more than one tile of inputs; from 32 the
    // rows are decoded into panels shared by chunks of 5-6 inputs (AVX-512) or 3-4 (AVX2), so
    // 32-36 leave every width of those.
    for n in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32, 33, 34, 35, 36] {
        let copied: Vec<&[f32]> = xs[..n].iter().map(|x| &x[..]).collect();
        for (isa, refs) in Isa::available().into_iter().flat_map(|isa| [(isa, copied.clone()), (isa, lined.refs()[..n].to_vec())]) {
            for block in [0..rows, 3..rows, 5..6] {
                let mut out = vec![f32::NAN; block.len() * n];
                matmul_mxfp4(isa, &refs, &w, block.clone(), &mut out);
                for (i, r) in block.clone().enumerate() {
                    for (t, x) in refs.iter().enumerate() {
                        assert_eq!(
                            out[i * n + t].to_bits(),
                            lone(x, r).to_bits(),
                            "{isa:?}, {n} inputs, rows {block:?}: row {r}, input {t}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_cpus_simd_kernels_are_under_test() {
    let isas = Isa::available();
    #[cfg(target_arch = "aarch64")]
    assert!(isas.iter().any(|i| i.kind() == IsaKind::Neon), "NEON must be exercised on aarch64: {isas:?}");
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        assert!(isas.iter().any(|i| i.kind() == IsaKind::Avx2), "{isas:?}");
    }
    assert_eq!(isas[0], Isa::SCALAR);
}

#[test]
fn e8m0_and_e2m1_decode() {
    assert_eq!(e8m0_scale(127), 1.0);
    assert_eq!(e8m0_scale(128), 2.0);
    assert_eq!(e8m0_scale(0), 2f32.powi(-127));
    assert_eq!(e8m0_scale(254), 2f32.powi(127));
    assert_eq!(e2m1_value(7), 6.0);
    assert_eq!(e2m1_value(0xF), -6.0);
    assert_eq!(e2m1_value(9), -0.5);
}

#[test]
fn matmul_rows_are_batch_and_isa_invariant() {
    let mut rng = Rng(3);
    // 13 token rows: groups of eight and four share a weight row, one is left alone; 56 columns
    // leave a tail of 8 past the 16-lane blocks. 45 token rows span two token tiles; 1048
    // columns cross the prompt tiles' K blocks (512 or 1024 columns) with a partial last block
    // and a tail; 37 weight rows leave a row past the 2-row tiles. From 32 token rows the weights
    // are widened into panels (K blocks of 1024 columns) shared by tiles of 4 rows x 6 token rows
    // (AVX-512) or 2 x 4 (AVX2): 32, 34, 35 and 45 leave every tail of those; 300 columns are
    // one partial K block and a tail, 2100 two whole ones, a partial one and a tail.
    // 3 token rows of 4104 columns: decode-sized rows side by side (from 4096 columns), with a
    // tail; shorter decode-sized rows run one after another.
    for (t, rows, cols) in [(13, 70, 56), (45, 37, 1048), (32, 6, 300), (34, 5, 300), (35, 9, 2100), (3, 9, 4104), (2, 7, 100)] {
        let x = Mat::from_vec(t, cols, (0..t * cols).map(|_| rng.f32()).collect());
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.f32()).collect();
        let w = Bf16Matrix::from_bytes(Bytes::from_vec(bf16_bytes(&w)), rows, cols);
        let full = matmul_bf16_with(Isa::SCALAR, &x, &w);
        let bits = |m: &Mat| m.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for isa in Isa::available() {
            assert_eq!(bits(&matmul_bf16_with(isa, &x, &w)), bits(&full), "{isa:?}, {t} x {cols}");
            for r in 0..t {
                let one = matmul_bf16_with(isa, &x.rows_range(r, 1), &w);
                let lone: Vec<u32> = one.row(0).iter().map(|v| v.to_bits()).collect();
                assert_eq!(lone, full.row(r).iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "row {r} alone differs ({isa:?})");
            }
        }
    }
}

#[test]
fn an_isa_exists_only_where_the_cpu_runs_it() {
    assert_eq!(Isa::new(IsaKind::Scalar), Some(Isa::SCALAR));
    #[cfg(target_arch = "x86_64")]
    {
        assert_eq!(Isa::new(IsaKind::Avx512).is_some(), std::is_x86_feature_detected!("avx512f"));
        assert_eq!(Isa::new(IsaKind::Avx2).is_some(), std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"));
        assert_eq!(Isa::new(IsaKind::Neon), None);
    }
    assert!(Isa::available().iter().all(|i| Isa::new(i.kind()).map(Isa::kind) == Some(i.kind())));
}

#[test]
fn both_prompt_kernels_of_each_x86_path_are_under_test() {
    for kind in [IsaKind::Avx2, IsaKind::Avx512] {
        if Isa::new(kind).is_some() {
            for kernel in [PromptKernel::Panels, PromptKernel::RegisterTiles] {
                let found = Isa::available().iter().any(|i| i.kind() == kind && i.prompt_kernel() == kernel);
                assert!(found, "{kind:?} on {kernel:?} is missing from Isa::available()");
            }
        }
    }
}
