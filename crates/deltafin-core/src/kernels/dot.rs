//! 16-lane dot products with one fixed reduction order, in scalar, AVX2+FMA and AVX-512F.

use crate::weights::bf16_to_f32;

/// Number of accumulation lanes; part of the numerical definition of every kernel.
pub const LANES: usize = 16;

/// An instruction set kernels can run on. All produce identical bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IsaKind {
    Scalar,
    Avx2,
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

/// Proof that this CPU runs an instruction set: the kernels' `unsafe` SIMD paths are sound only
/// because an `Isa` other than scalar cannot be made without feature detection (the field is
/// private; [`Isa::new`] checks):
///
/// ```compile_fail
/// let avx512 = deltafin_core::Isa(deltafin_core::IsaKind::Avx512);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Isa(IsaKind, PromptKernel);

/// How the x86 MXFP4 kernels run an expert's products for a prompt's many token rows (32 or
/// more). Both give the same bits (every value keeps its lone dot's chain); which is faster
/// depends on the core. (BF16 prompt products stay on panels: on AMD's AVX-512 their register
/// tiles won at K3's expert shape in the kernel bench but lost 11% of a 256-token prefill on
/// `small`, whose spine is narrow.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PromptKernel {
    /// A block's weight rows decoded (MXFP4) or widened (BF16) once per K block into an F32
    /// panel that plain F32 tiles share, so the decode's shuffles are paid once per weight for
    /// every token row: the choice where shuffles are scarce (Intel's AVX-512 has one port for
    /// them; the kernel bench measured panels 1.3x the register tiles on a Xeon).
    Panels,
    /// The register tiles of decode-sized products, cut along K: each weight decoded in
    /// registers for up to 4 token rows. AMD's AVX-512 (Zen 4) runs 512-bit shuffles on two
    /// pipes and FMAs at half the Xeon's width, so the decode hides under the FMAs and the
    /// panels' extra pass over each weight costs more than it saves (the kernel bench there:
    /// register tiles 1.08x-1.10x the panels at 64 and 512 token rows).
    RegisterTiles,
}

impl PromptKernel {
    /// The kernel this one is not (tests and the kernel bench run both).
    pub fn other(self) -> PromptKernel {
        match self {
            PromptKernel::Panels => PromptKernel::RegisterTiles,
            PromptKernel::RegisterTiles => PromptKernel::Panels,
        }
    }
}

/// Whether this is an AMD CPU (CPUID leaf 0's vendor string), asked once: `Isa::best` runs on
/// hot paths, and under a hypervisor every CPUID traps to it.
#[cfg(target_arch = "x86_64")]
fn amd_cpu() -> bool {
    static AMD: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
        // SAFETY: CPUID exists on every x86-64 CPU, and leaf 0 on every CPU that has CPUID.
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut vendor = [0u8; 12];
        for (i, reg) in [id.ebx, id.edx, id.ecx].into_iter().enumerate() {
            vendor[4 * i..4 * i + 4].copy_from_slice(&reg.to_le_bytes());
        }
        &vendor == b"AuthenticAMD"
    });
    *AMD
}

impl Isa {
    /// The scalar reference, on any CPU.
    pub const SCALAR: Isa = Isa(IsaKind::Scalar, PromptKernel::Panels);

    /// `kind`, if this CPU supports it.
    pub fn new(kind: IsaKind) -> Option<Isa> {
        let ok = match kind {
            IsaKind::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx512 => std::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "aarch64")]
            IsaKind::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        };
        #[cfg(target_arch = "x86_64")]
        let prompts = if kind == IsaKind::Avx512 && amd_cpu() { PromptKernel::RegisterTiles } else { PromptKernel::Panels };
        #[cfg(not(target_arch = "x86_64"))]
        let prompts = PromptKernel::Panels;
        ok.then_some(Isa(kind, prompts))
    }
    /// Which instruction set this is.
    pub fn kind(self) -> IsaKind {
        self.0
    }
    /// How a prompt's products run on this CPU (x86 only; other paths have one kernel).
    pub fn prompt_kernel(self) -> PromptKernel {
        self.1
    }
    /// The same instruction set with a prompt's products on `kernel` (the kernel bench measures
    /// both; the bits are the same).
    pub fn with_prompt_kernel(self, kernel: PromptKernel) -> Isa {
        Isa(self.0, kernel)
    }
    /// The fastest kernel this CPU supports.
    pub fn best() -> Isa {
        [IsaKind::Neon, IsaKind::Avx512, IsaKind::Avx2].into_iter().find_map(Isa::new).unwrap_or(Isa::SCALAR)
    }
    /// Every kernel this CPU can run (for tests), the scalar reference first; x86's SIMD paths
    /// twice, on each [`PromptKernel`] (this CPU's choice first).
    pub fn available() -> Vec<Isa> {
        let mut all = Vec::new();
        for isa in [IsaKind::Scalar, IsaKind::Neon, IsaKind::Avx2, IsaKind::Avx512].into_iter().filter_map(Isa::new) {
            all.push(isa);
            if matches!(isa.kind(), IsaKind::Avx2 | IsaKind::Avx512) {
                all.push(isa.with_prompt_kernel(isa.prompt_kernel().other()));
            }
        }
        all
    }
}

/// The fixed reduction tree over 16 lanes: halves, quarters, pairs.
#[inline(always)]
pub(crate) fn reduce_lanes(acc: &[f32; LANES]) -> f32 {
    let mut a = [0f32; 8];
    for j in 0..8 {
        a[j] = acc[j] + acc[j + 8];
    }
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let c = [b[0] + b[2], b[1] + b[3]];
    c[0] + c[1]
}

/// `sum_i x[i] * w[i]` with `w` little-endian BF16 bytes.
pub fn dot_bf16(isa: Isa, x: &[f32], w: &[u8]) -> f32 {
    assert_eq!(w.len(), x.len() * 2, "dot_bf16: length mismatch");
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` of `Avx2`/`Avx512` is only made after feature detection (`Isa::new`).
        IsaKind::Avx2 => unsafe { x86::dot_bf16_avx2(x, w) },
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx512 => unsafe { x86::dot_bf16_avx512(x, w) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: an `Isa` of `Neon` is only made after feature detection (`Isa::new`).
        IsaKind::Neon => unsafe { super::neon::dot_bf16_neon(x, w) },
        _ => dot_bf16_scalar(x, w, 0, [0.0; LANES]),
    }
}

/// `out[j] = dot_bf16(isa, xs[j], w)` for every input: the weight row is widened once per 16
/// elements for several inputs whose accumulations run side by side (independent FMA chains),
/// each in its own lanes and in the same order as alone, so every value equals its lone dot.
pub fn dot_bf16_inputs(isa: Isa, xs: &[&[f32]], w: &[u8], out: &mut [f32]) {
    assert_eq!(xs.len(), out.len(), "dot_bf16_inputs: one output per input");
    for x in xs {
        assert_eq!(w.len(), x.len() * 2, "dot_bf16_inputs: length mismatch");
    }
    let lone = |j: usize| dot_bf16(isa, xs[j], w);
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` of `Avx512` is only made after feature detection; lengths checked.
        IsaKind::Avx512 => in_groups::<8>(out, |j| unsafe { x86::dot_bf16_n_avx512::<8>(&xs[j..j + 8], w) }, lone),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for `Avx2`.
        IsaKind::Avx2 => in_groups::<4>(out, |j| unsafe { x86::dot_bf16_n_avx2::<4>(&xs[j..j + 4], w) }, lone),
        _ => in_groups::<1>(out, |j| [lone(j)], lone),
    }
}

/// Columns from which [`dot_bf16_rows`] runs 4 rows side by side. Shorter rows go one after
/// another: a matrix's rows are adjacent, so that reads it as one sequential stream the hardware
/// prefetcher follows, where 4 rows side by side are 4 streams of a few KB each, restarted every
/// 4 rows, that it never ramps up on. The kernel bench measures both from DRAM: on a Zen 4 EPYC
/// one after another read 1024-column rows at 30-37 GiB/s against 19-20 side by side, while at
/// 7168 columns side by side led (27 against 22 GiB/s for lone dots).
const ROWS_SIDE_BY_SIDE_FROM: usize = 4096;

/// `out[j] = dot_bf16(isa, x, ws[j])` for every weight row: from [`ROWS_SIDE_BY_SIDE_FROM`]
/// columns one input against several rows, their accumulations side by side (independent FMA
/// chains: a lone dot is bound by FMA latency), each in the same lanes and order as alone.
pub fn dot_bf16_rows(isa: Isa, x: &[f32], ws: &[&[u8]], out: &mut [f32]) {
    if x.len() >= ROWS_SIDE_BY_SIDE_FROM {
        return dot_bf16_rows_side_by_side(isa, x, ws, out);
    }
    assert_eq!(ws.len(), out.len(), "dot_bf16_rows: one output per row");
    // `dot_bf16` checks each row's length.
    for (o, w) in out.iter_mut().zip(ws) {
        *o = dot_bf16(isa, x, w);
    }
}

/// [`dot_bf16_rows`] with the rows side by side whatever their length: the baseline the kernel
/// benchmark measures short rows one after another against, bit-identical to it.
#[doc(hidden)]
pub fn dot_bf16_rows_side_by_side(isa: Isa, x: &[f32], ws: &[&[u8]], out: &mut [f32]) {
    assert_eq!(ws.len(), out.len(), "dot_bf16_rows: one output per row");
    for w in ws {
        assert_eq!(w.len(), x.len() * 2, "dot_bf16_rows: length mismatch");
    }
    let lone = |j: usize| dot_bf16(isa, x, ws[j]);
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` of `Avx512` is only made after feature detection; lengths checked.
        IsaKind::Avx512 => in_groups::<4>(out, |j| unsafe { x86::dot_bf16_rows_avx512::<4>(x, &ws[j..j + 4]) }, lone),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for `Avx2`.
        IsaKind::Avx2 => in_groups::<4>(out, |j| unsafe { x86::dot_bf16_rows_avx2::<4>(x, &ws[j..j + 4]) }, lone),
        _ => in_groups::<1>(out, |j| [lone(j)], lone),
    }
}

/// Fills `out` `G` values at a time from `group(first)`, the remainder one `lone(j)` each.
#[inline(always)]
fn in_groups<const G: usize>(out: &mut [f32], group: impl Fn(usize) -> [f32; G], lone: impl Fn(usize) -> f32) {
    let full = out.len() / G * G;
    for j in (0..full).step_by(G) {
        out[j..j + G].copy_from_slice(&group(j));
    }
    for (j, o) in out.iter_mut().enumerate().skip(full) {
        *o = lone(j);
    }
}

/// `sum_i x[i] * w[i]` in F32.
pub fn dot_f32(isa: Isa, x: &[f32], w: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_f32: length mismatch");
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx2 => unsafe { x86::dot_f32_avx2(x, w) },
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx512 => unsafe { x86::dot_f32_avx512(x, w) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        IsaKind::Neon => unsafe { super::neon::dot_f32_neon(x, w) },
        _ => dot_f32_scalar(x, w, 0, [0.0; LANES]),
    }
}

/// Scalar reference from element `start` on, continuing the given lanes (SIMD tails use it too).
pub(crate) fn dot_bf16_scalar(x: &[f32], w: &[u8], start: usize, mut acc: [f32; LANES]) -> f32 {
    for i in start..x.len() {
        let wi = bf16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]]));
        acc[i % LANES] = x[i].mul_add(wi, acc[i % LANES]);
    }
    reduce_lanes(&acc)
}

pub(crate) fn dot_f32_scalar(x: &[f32], w: &[f32], start: usize, mut acc: [f32; LANES]) -> f32 {
    for i in start..x.len() {
        acc[i % LANES] = x[i].mul_add(w[i], acc[i % LANES]);
    }
    reduce_lanes(&acc)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! x86 SIMD versions; each mirrors the scalar lane scheme exactly.
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    pub(crate) unsafe fn store2(lo: __m256, hi: __m256) -> [f32; LANES] {
        let mut acc = [0f32; LANES];
        // SAFETY: acc has 16 floats.
        unsafe {
            _mm256_storeu_ps(acc.as_mut_ptr(), lo);
            _mm256_storeu_ps(acc.as_mut_ptr().add(8), hi);
        }
        acc
    }

    #[inline(always)]
    unsafe fn bf16x8(p: *const u8) -> __m256 {
        // SAFETY: caller guarantees 16 readable bytes at p.
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot_bf16_avx2(x: &[f32], w: &[u8]) -> f32 {
        let n = x.len() / LANES * LANES;
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= x.len() and w has 2 bytes per element.
            unsafe {
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i)), bf16x8(w.as_ptr().add(2 * i)), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i + 8)), bf16x8(w.as_ptr().add(2 * i + 16)), hi);
            }
            i += LANES;
        }
        // SAFETY: plain stores into a local array.
        dot_bf16_scalar(x, w, n, unsafe { store2(lo, hi) })
    }

    /// `N` inputs against one BF16 row: the row widened once, `N` chains of two accumulators.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot_bf16_n_avx2<const N: usize>(xs: &[&[f32]], w: &[u8]) -> [f32; N] {
        let len = w.len() / 2;
        let n = len / LANES * LANES;
        let mut lo = [_mm256_setzero_ps(); N];
        let mut hi = [_mm256_setzero_ps(); N];
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= len for every input (the caller checked lengths).
            unsafe {
                let (wl, wh) = (bf16x8(w.as_ptr().add(2 * i)), bf16x8(w.as_ptr().add(2 * i + 16)));
                for j in 0..N {
                    lo[j] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[j].as_ptr().add(i)), wl, lo[j]);
                    hi[j] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[j].as_ptr().add(i + 8)), wh, hi[j]);
                }
            }
            i += LANES;
        }
        // SAFETY: plain stores into local arrays.
        std::array::from_fn(|j| dot_bf16_scalar(xs[j], w, n, unsafe { store2(lo[j], hi[j]) }))
    }

    /// Asks for the line `ahead` bytes past each row's position: in a matrix, the same
    /// columns of the rows the next call takes. Rows of a few KB end before the hardware
    /// prefetcher ramps up, so decode-sized products over weights from DRAM would wait on each
    /// line (a prefetch never faults, so past the matrix's end is harmless).
    #[inline(always)]
    pub(crate) fn prefetch_rows(ws: &[&[u8]], ahead: usize) {
        for w in ws {
            // SAFETY: a prefetch reads nothing into the program and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(ahead) as *const i8) };
        }
    }

    /// One input against `N` BF16 rows: the input loaded once, `N` chains of two accumulators.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot_bf16_rows_avx2<const N: usize>(x: &[f32], ws: &[&[u8]]) -> [f32; N] {
        let n = x.len() / LANES * LANES;
        let mut lo = [_mm256_setzero_ps(); N];
        let mut hi = [_mm256_setzero_ps(); N];
        let mut i = 0;
        let ahead = N * 2 * x.len();
        while i < n {
            // SAFETY: i + 16 <= x.len() and every row has 2 bytes per element (caller checked).
            unsafe {
                if i.is_multiple_of(32) {
                    prefetch_rows(ws, ahead + 2 * i);
                }
                let (xl, xh) = (_mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(x.as_ptr().add(i + 8)));
                for j in 0..N {
                    lo[j] = _mm256_fmadd_ps(xl, bf16x8(ws[j].as_ptr().add(2 * i)), lo[j]);
                    hi[j] = _mm256_fmadd_ps(xh, bf16x8(ws[j].as_ptr().add(2 * i + 16)), hi[j]);
                }
            }
            i += LANES;
        }
        // SAFETY: plain stores into local arrays.
        std::array::from_fn(|j| dot_bf16_scalar(x, ws[j], n, unsafe { store2(lo[j], hi[j]) }))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot_f32_avx2(x: &[f32], w: &[f32]) -> f32 {
        let n = x.len() / LANES * LANES;
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= len of both slices.
            unsafe {
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(w.as_ptr().add(i)), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i + 8)), _mm256_loadu_ps(w.as_ptr().add(i + 8)), hi);
            }
            i += LANES;
        }
        dot_f32_scalar(x, w, n, unsafe { store2(lo, hi) })
    }

    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn store16(v: __m512) -> [f32; LANES] {
        let mut acc = [0f32; LANES];
        // SAFETY: acc has 16 floats.
        unsafe { _mm512_storeu_ps(acc.as_mut_ptr(), v) };
        acc
    }

    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn dot_bf16_avx512(x: &[f32], w: &[u8]) -> f32 {
        let n = x.len() / LANES * LANES;
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= x.len(); 32 bytes of w readable.
            unsafe {
                let h = _mm256_loadu_si256(w.as_ptr().add(2 * i) as *const __m256i);
                let wf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(x.as_ptr().add(i)), wf, acc);
            }
            i += LANES;
        }
        dot_bf16_scalar(x, w, n, unsafe { store16(acc) })
    }

    /// `N` inputs against one BF16 row: the row widened once, `N` independent chains.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn dot_bf16_n_avx512<const N: usize>(xs: &[&[f32]], w: &[u8]) -> [f32; N] {
        let len = w.len() / 2;
        let n = len / LANES * LANES;
        let mut acc = [_mm512_setzero_ps(); N];
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= len for every input; 32 bytes of w readable.
            unsafe {
                let h = _mm256_loadu_si256(w.as_ptr().add(2 * i) as *const __m256i);
                let wf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                for j in 0..N {
                    acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[j].as_ptr().add(i)), wf, acc[j]);
                }
            }
            i += LANES;
        }
        std::array::from_fn(|j| dot_bf16_scalar(xs[j], w, n, unsafe { store16(acc[j]) }))
    }

    /// One input against `N` BF16 rows: the input loaded once, `N` independent chains.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn dot_bf16_rows_avx512<const N: usize>(x: &[f32], ws: &[&[u8]]) -> [f32; N] {
        let n = x.len() / LANES * LANES;
        let mut acc = [_mm512_setzero_ps(); N];
        let mut i = 0;
        let ahead = N * 2 * x.len();
        while i < n {
            // SAFETY: i + 16 <= x.len(); 32 bytes of each row readable.
            unsafe {
                if i.is_multiple_of(32) {
                    prefetch_rows(ws, ahead + 2 * i);
                }
                let xv = _mm512_loadu_ps(x.as_ptr().add(i));
                for j in 0..N {
                    let h = _mm256_loadu_si256(ws[j].as_ptr().add(2 * i) as *const __m256i);
                    let wf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                    acc[j] = _mm512_fmadd_ps(xv, wf, acc[j]);
                }
            }
            i += LANES;
        }
        std::array::from_fn(|j| dot_bf16_scalar(x, ws[j], n, unsafe { store16(acc[j]) }))
    }

    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn dot_f32_avx512(x: &[f32], w: &[f32]) -> f32 {
        let n = x.len() / LANES * LANES;
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= len of both slices.
            unsafe { acc = _mm512_fmadd_ps(_mm512_loadu_ps(x.as_ptr().add(i)), _mm512_loadu_ps(w.as_ptr().add(i)), acc) };
            i += LANES;
        }
        dot_f32_scalar(x, w, n, unsafe { store16(acc) })
    }
}
