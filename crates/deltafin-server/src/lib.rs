//! The OpenAI-compatible HTTP server over the `deltafin-sched` API.
//!
//! Not built yet (see the open issue): this crate is where HTTP and the OpenAI JSON shapes will
//! live, and nowhere else. It exports nothing today.
