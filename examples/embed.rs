//! Embedding Deltafin: open a model, chat with it, stream the reply, read the stats.
//!
//! ```sh
//! cargo run --release --example embed -- [MODEL_DIR] [PROMPT]
//! ```
//! MODEL_DIR is a checkpoint folder or a store made by `deltafin setup`; it defaults to the tiny
//! fixture checkpoint that ships with the repository.

use std::io::Write;

use deltafin::{EngineBuilder, GenerateOptions, Generator, Message, Output, Role, Stats, Step, StreamDecoder};

/// Streams the reply to stdout as complete UTF-8 arrives, and prints the stats at the end.
struct Printer<'t> {
    text: Option<StreamDecoder<'t>>,
}

impl Output for Printer<'_> {
    fn token(&mut self, step: Step<'_>) -> bool {
        if let Some(t) = &mut self.text {
            print!("{}", t.push(step.id));
        }
        let _ = std::io::stdout().flush();
        true
    }
    fn finish(&mut self, stats: &Stats) {
        println!("{}", self.text.take().map(|t| t.finish()).unwrap_or_default());
        eprintln!("{}", stats.summary());
    }
}

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

    // Generate greedily; a generator keeps the state for the next turn of the conversation.
    let mut generator = Generator::new(&model);
    generator.generate(&ids, &opts, &mut Printer { text: Some(model.tokenizer().stream()) })?;
    Ok(())
}
