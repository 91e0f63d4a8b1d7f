//! Programs that embed the Deltafin API; see `embed.rs` (`cargo run --example embed`).
