//! The decode's hot tile written out in assembly: AVX2 + FMA, 3 weight rows by 1 input.
//!
//! One token against an expert matrix (decode) spends its time here, and the compiler's version
//! of the same tile (`tile_avx2::<3, 1>`) holds the input's four vectors in registers for the
//! three rows, which leaves too few for the six accumulators: it spills three of them and reloads
//! its constants every group. Written out, the accumulators, the three decode constants and seven
//! temporaries fill the 16 registers exactly, the input is read by the fused multiply-adds from
//! L1 instead, and each row's code bytes are widened for all three rows before any of them is
//! looked up (the table lookups wait on a byte load, an address and a second load).
//!
//! The arithmetic is `decode_group_avx2`'s and `tile_avx2`'s instruction for instruction: the
//! same byte tables, shuffles and masks, and per lane the even column's FMA, then the odd
//! one's, group by group. So every value is the lone dot's, bit for bit (the kernel tests compare
//! it with the scalar reference on every scale byte and code, and on tails and K blocks).
//!
//! The loop takes 4 groups a pass (64 bytes of codes per row: one line to ask for ahead) and
//! counts up to zero from minus the group count, so its pointers are set past the groups' end.

use std::arch::x86_64::*;

use super::mxfp4_x86::{Lanes, Tile};

/// Groups a pass of the loop takes; the caller runs the remainder through `tile_avx2`.
pub(super) const GROUPS_PER_PASS: usize = 4;

/// Widens row `p`'s codes of the group at byte offset `co` into nibbles in `ymm{n}`: each 16-bit
/// word one code byte, its even column's code in the low byte and its odd column's in the high
/// one (`decode_group_avx2`'s first three steps; `ymm12` is scratch).
macro_rules! nibbles {
    ($p:literal, $co:literal, $n:literal) => {
        concat!(
            "vbroadcasti128 ymm",
            $n,
            ", xmmword ptr [{p",
            $p,
            "} + {g16} + ",
            $co,
            "]\n",
            "vpshufb ymm",
            $n,
            ", ymm",
            $n,
            ", ymm6\n",
            "vpsllw ymm12, ymm",
            $n,
            ", 4\n",
            "vpor ymm",
            $n,
            ", ymm",
            $n,
            ", ymm12\n",
            "vpand ymm",
            $n,
            ", ymm",
            $n,
            ", ymm7\n",
        )
    };
}

/// Looks row `p`'s nibbles (`ymm{n}`) up in the tables of its scale byte (offset `so` from the
/// pass's first group), splits the words into F32 values and adds them into the row's lanes 0-7
/// (`ymm{a}`) and 8-15 (`ymm{b}`) against the input at byte offset `xo` of the pass: lanes 0-7's
/// even columns at `xo`, their odd columns 64 bytes on, lanes 8-15's at 32 and 96.
macro_rules! lookup_and_add {
    ($p:literal, $so:literal, $n:literal, $a:literal, $b:literal, $xe0:literal, $xe8:literal, $xo0:literal, $xo8:literal) => {
        concat!(
            "movzx {t:e}, byte ptr [{s",
            $p,
            "} + {g} + ",
            $so,
            "]\n",
            "shl {t:e}, 5\n",
            "vbroadcasti128 ymm12, xmmword ptr [{tab} + {t}]\n",
            "vbroadcasti128 ymm13, xmmword ptr [{tab} + {t} + 16]\n",
            "vpshufb ymm12, ymm12, ymm",
            $n,
            "\n",
            "vpshufb ymm13, ymm13, ymm",
            $n,
            "\n",
            "vpunpcklbw ymm14, ymm12, ymm13\n",
            "vpunpckhbw ymm15, ymm12, ymm13\n",
            "vpslld ymm12, ymm14, 16\n",
            "vpand ymm14, ymm14, ymm8\n",
            "vpslld ymm13, ymm15, 16\n",
            "vpand ymm15, ymm15, ymm8\n",
            "vfmadd231ps ymm",
            $a,
            ", ymm12, ymmword ptr [{x} + {g16}*8 + ",
            $xe0,
            "]\n",
            "vfmadd231ps ymm",
            $a,
            ", ymm14, ymmword ptr [{x} + {g16}*8 + ",
            $xo0,
            "]\n",
            "vfmadd231ps ymm",
            $b,
            ", ymm13, ymmword ptr [{x} + {g16}*8 + ",
            $xe8,
            "]\n",
            "vfmadd231ps ymm",
            $b,
            ", ymm15, ymmword ptr [{x} + {g16}*8 + ",
            $xo8,
            "]\n",
        )
    };
}

/// One group of the pass (codes at `co`, scale at `so`, input at `xo..xo + 128` bytes) for the
/// three rows: their nibbles first, then each row's lookups and FMAs.
macro_rules! group {
    ($co:literal, $so:literal, $x0:literal, $x1:literal, $x2:literal, $x3:literal) => {
        concat!(
            nibbles!(0, $co, 9),
            nibbles!(1, $co, 10),
            nibbles!(2, $co, 11),
            lookup_and_add!(0, $so, 9, 0, 1, $x0, $x1, $x2, $x3),
            lookup_and_add!(1, $so, 10, 2, 3, $x0, $x1, $x2, $x3),
            lookup_and_add!(2, $so, 11, 4, 5, $x0, $x1, $x2, $x3),
        )
    };
}

/// Continues `acc` over the tile's groups, whose count must be a positive multiple of
/// [`GROUPS_PER_PASS`]. `table` is `byte_tables()`; `spread`, `nibble_mask` and `top` are
/// `decode_group_avx2`'s constants.
///
/// # Safety
/// AVX2 and FMA must be available; every pointer must cover the tile's groups.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_3x1(
    tile: &Tile<'_, 3, 1>,
    table: &[[[u8; 16]; 2]; 256],
    (spread, nibble_mask, top): (__m256i, __m256i, __m256i),
    acc_io: &mut Lanes<3, 1>,
) {
    let (start, end) = (tile.groups.start, tile.groups.end);
    let count = end - start;
    debug_assert!(count > 0 && count.is_multiple_of(GROUPS_PER_PASS));
    // SAFETY: lanes 0-7 and 8-15 of a `[f32; 16]` are two 32-byte vectors.
    let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_ps(acc_io[i / 2][0].as_ptr().add(8 * (i % 2))) });
    // The scales of the next tile's rows over these groups (a line holds 64), asked for once.
    for r in 0..3 {
        for g in (start..end).step_by(64) {
            // A prefetch is a hint: it never faults, whatever the address.
            _mm_prefetch::<_MM_HINT_T0>(tile.scales[r].wrapping_add(tile.ahead.1 + g) as *const i8);
        }
    }
    // Pointers past the last group, indexed by minus the groups (and bytes of codes) left.
    let codes_end = |r: usize| tile.packed[r].wrapping_add(16 * end);
    let scales_end = |r: usize| tile.scales[r].wrapping_add(end);
    let ahead_end = |r: usize| tile.packed[r].wrapping_add(16 * end + tile.ahead.0);
    // SAFETY: the caller's contract: every address the loop reads lies in the rows' codes and
    // scales for these groups, the input's floats for them, or the table (a scale byte times 32
    // plus at most 31); prefetches never fault.
    unsafe {
        std::arch::asm!(
            "2:",
            "prefetcht0 byte ptr [{q0} + {g16}]",
            "prefetcht0 byte ptr [{q1} + {g16}]",
            "prefetcht0 byte ptr [{q2} + {g16}]",
            group!(0, 0, 0, 32, 64, 96),
            group!(16, 1, 128, 160, 192, 224),
            group!(32, 2, 256, 288, 320, 352),
            group!(48, 3, 384, 416, 448, 480),
            "add {g16}, 64",
            "add {g}, 4",
            "jnz 2b",
            p0 = in(reg) codes_end(0),
            p1 = in(reg) codes_end(1),
            p2 = in(reg) codes_end(2),
            s0 = in(reg) scales_end(0),
            s1 = in(reg) scales_end(1),
            s2 = in(reg) scales_end(2),
            q0 = in(reg) ahead_end(0),
            q1 = in(reg) ahead_end(1),
            q2 = in(reg) ahead_end(2),
            x = in(reg) tile.xs[0].wrapping_add(32 * end),
            tab = in(reg) table.as_ptr(),
            g = inout(reg) -(count as isize) => _,
            g16 = inout(reg) -16 * count as isize => _,
            t = out(reg) _,
            inout("ymm0") a0,
            inout("ymm1") a1,
            inout("ymm2") a2,
            inout("ymm3") a3,
            inout("ymm4") a4,
            inout("ymm5") a5,
            in("ymm6") spread,
            in("ymm7") nibble_mask,
            in("ymm8") top,
            out("ymm9") _,
            out("ymm10") _,
            out("ymm11") _,
            out("ymm12") _,
            out("ymm13") _,
            out("ymm14") _,
            out("ymm15") _,
            options(nostack, readonly),
        );
    }
    for (i, a) in [a0, a1, a2, a3, a4, a5].into_iter().enumerate() {
        // SAFETY: as for the loads above.
        unsafe { _mm256_storeu_ps(acc_io[i / 2][0].as_mut_ptr().add(8 * (i % 2)), a) };
    }
}
