//! The hot loops: dot products over BF16, F32 and MXFP4 bytes, and the matmuls built on them.
//!
//! **Batch invariance by construction.** Every dot product uses the same 16-lane accumulation
//! scheme: element `i` of a row is fused-multiply-added into lane `i % 16` in ascending order, and
//! the 16 lanes are reduced by one fixed tree. The scalar, AVX2 and AVX-512 versions perform the
//! same IEEE operations in the same order, so they agree bit for bit (tested), and an output value
//! never depends on how many rows are computed together, the thread count, or the CPU.

#[cfg(target_arch = "x86_64")]
mod bf16_x86;
mod chunks;
mod dot;
mod lined;
mod matmul;
mod mxfp4;
#[cfg(target_arch = "x86_64")]
mod mxfp4_avx2_asm;
#[cfg(target_arch = "x86_64")]
mod mxfp4_x86;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod panel_x86;

pub use chunks::{first_come, for_row_chunks, on_compute_threads, row_chunks};
pub use dot::{dot_bf16, dot_bf16_inputs, dot_bf16_rows, dot_bf16_rows_side_by_side, dot_f32, Isa, IsaKind, PromptKernel, LANES};
pub use lined::LinedRows;
pub use matmul::{matmul_bf16, matmul_bf16_with, matmul_bf16_without_panels};
pub use mxfp4::{
    dot_mxfp4, dot_mxfp4_inputs, e2m1_value, e8m0_scale, matmul_mxfp4, matmul_mxfp4_without_assembly, permute_for_mxfp4,
    permute_for_mxfp4_into, Mxfp4Matrix,
};

#[cfg(test)]
mod tests;
