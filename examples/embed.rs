//! Embedding Deltafin: open a model, chat with it, stream the reply, read the stats.
//!
//! ```sh
//! cargo run --release --example embed -- [MODEL_DIR] [PROMPT]
//! ```
//! MODEL_DIR is a checkpoint folder or a store made by `deltafin setup`; it defaults to the tiny
//! fixture checkpoint that ships with the repository.

use std::io::Write;

use deltafin::{EngineBuilder, GenerateOptions, Message, Role};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-k3-dev/checkpoint").to_string());
    let prompt = args.next().unwrap_or_else(|| "Say hello in three languages.".to_string());

    // Open: parses config.json, checks every spine tensor, starts the expert source.
    let model = EngineBuilder::new(&dir).context(2048).open()?;

    // Render a conversation in K3's chat format; user text can never inject control tokens.
    let chat = model.chat()?;
    let ids = chat.render(&[Message::new(Role::System, "You are concise."), Message::new(Role::User, prompt)], Some("low"))?;
    let opts = GenerateOptions::new(32).stop_ids(chat.stop_ids());

    // Generate greedily, streaming complete UTF-8 as it arrives.
    let mut seq = model.new_sequence();
    let mut text = model.tokenizer().stream();
    let mut out = std::io::stdout();
    let stats = model.engine().generate(&mut seq, &ids, &opts, |id| {
        let _ = write!(out, "{}", text.push(id));
        let _ = out.flush();
        true
    })?;
    println!("{}", text.finish());
    eprintln!("{}", stats.summary());
    Ok(())
}
