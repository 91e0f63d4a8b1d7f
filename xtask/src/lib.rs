//! Library half of `cargo xtask`, so tests can generate the same models the command writes.
#![recursion_limit = "256"]

pub mod bench;
pub mod demo;
pub mod fuzz_store;
pub mod gen_k3;
pub mod gen_qwen3;
pub mod hub_emulator;
pub mod oracle;
#[cfg(feature = "train")]
pub mod train_tokenizer;
pub mod trained;
