//! The GPU's weight layout: each row lane-major, so lane j's chain reads contiguous bytes (see
//! `kernels.cu`). BF16 is permuted on the host when it is uploaded; MXFP4 experts cross the bus as
//! stored and are permuted by `mxfp4_to_lanes` on the GPU (`mxfp4_lanes` is its reference).

use rayon::prelude::*;

/// A BF16 matrix `[rows, cols]` (little-endian bytes) as `[rows][16][cols/16]` values.
pub fn bf16_lanes(rows: usize, cols: usize, bytes: &[u8]) -> Result<Vec<u16>, String> {
    if !cols.is_multiple_of(16) || bytes.len() != rows * cols * 2 {
        return Err(format!("BF16 [{rows}, {cols}]: {} bytes, and the width must be a multiple of 16", bytes.len()));
    }
    let kl = cols / 16;
    let mut out = vec![0u16; rows * cols];
    if cols == 0 {
        return Ok(out);
    }
    // Rows on every core: a model's spine is permuted once, when it first reaches the GPU.
    out.par_chunks_mut(cols).zip(bytes.par_chunks(cols * 2)).for_each(|(dst, row)| {
        for c in 0..cols {
            let (m, j) = (c / 16, c % 16);
            dst[j * kl + m] = u16::from_le_bytes([row[2 * c], row[2 * c + 1]]);
        }
    });
    Ok(out)
}

/// MXFP4 codes `[rows, cols/2]` as `[rows][16][cols/32]` bytes: byte j of each group, lane by
/// lane. The scales keep their layout.
pub fn mxfp4_lanes(rows: usize, cols: usize, packed: &[u8], scales: &[u8]) -> Result<Vec<u8>, String> {
    if !cols.is_multiple_of(32) || packed.len() != rows * cols / 2 || scales.len() != rows * cols / 32 {
        return Err(format!(
            "MXFP4 [{rows}, {cols}]: {} code and {} scale bytes, and the width must be a multiple of 32",
            packed.len(),
            scales.len()
        ));
    }
    let g = cols / 32;
    let mut out = vec![0u8; rows * cols / 2];
    for r in 0..rows {
        let row = &packed[r * cols / 2..(r + 1) * cols / 2];
        let dst = &mut out[r * cols / 2..(r + 1) * cols / 2];
        for gi in 0..g {
            for j in 0..16 {
                dst[j * g + gi] = row[16 * gi + j];
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_hold_each_lanes_columns_in_chain_order() {
        let (rows, cols) = (2, 64);
        let bytes: Vec<u8> = (0..rows * cols).flat_map(|i| (i as u16).to_le_bytes()).collect();
        let l = bf16_lanes(rows, cols, &bytes).unwrap();
        // Row 1, lane 3, chain position 2: column 16 * 2 + 3.
        assert_eq!(l[cols + 3 * (cols / 16) + 2], (cols + 35) as u16);
        let packed: Vec<u8> = (0..rows * cols / 2).map(|i| i as u8).collect();
        let scales = vec![127u8; rows * cols / 32];
        let m = mxfp4_lanes(rows, cols, &packed, &scales).unwrap();
        // Row 0, lane 5, group 1: byte 16 * 1 + 5 of the row.
        assert_eq!(m[5 * 2 + 1], 21);
        assert!(bf16_lanes(1, 17, &[0; 34]).is_err());
        assert!(mxfp4_lanes(1, 32, &[0; 16], &[]).is_err());
    }
}
