//! `deltafin chat`: a terminal chat like llama-cli's and ollama's. Line editing and history
//! (rustyline), a spinner with the prompt's progress while it is processed, Ctrl-C that stops
//! prompt processing between layers (or a reply mid-way), K3's reasoning shown apart (dimmed)
//! from its answer, and a conversation that outgrows the context trimmed from its oldest turns
//! with a notice.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use deltafin::{Cancel, Message, OnToken, ReplyPart, ReplySplitter, Role, Step};
use rustyline::error::ReadlineError;

use crate::run::ModelArgs;

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 512)]
    pub max_new: usize,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: crate::sampling_args::SamplingArgs,
}

const HELP: &str = "Type a message and press Enter (arrow keys edit, Up/Down recall earlier lines). End a line with \\ to \
continue on the next.\nCommands: /stats (last reply's stats), /reset (new conversation), /clear (new conversation, clear screen), /help, /quit. Ctrl-C stops the \
prompt or the reply; Ctrl-D quits. Start a message with // to send a line beginning with /.";

/// Prompt tokens per pass when none is asked for (`--prefill-chunk`).
const PROMPT_CHUNK: usize = 256;

/// What Ctrl-C stops: the generation running now, if any.
#[derive(Clone, Default)]
struct Running(Arc<Mutex<Option<Cancel>>>, Arc<AtomicBool>);

impl Running {
    fn start(&self) -> Cancel {
        let c = Cancel::new();
        *self.0.lock().expect("poisoned") = Some(c.clone());
        self.1.store(false, Ordering::SeqCst);
        c
    }
    fn end(&self) {
        *self.0.lock().expect("poisoned") = None;
    }
    fn interrupt(&self) {
        self.1.store(true, Ordering::SeqCst);
        if let Some(c) = &*self.0.lock().expect("poisoned") {
            c.cancel();
        }
    }
    fn interrupted(&self) -> bool {
        self.1.load(Ordering::SeqCst)
    }
}

/// Shows a spinner with the prompt's progress (layers walked) until the first token.
struct Spinner {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Spinner {
    fn start(cancel: Cancel, prompt_tokens: usize, layers: u64, chunk: usize) -> Spinner {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let passes = prompt_tokens.div_ceil(chunk.max(1)) as u64;
        let thread = std::thread::spawn(move || {
            let t0 = Instant::now();
            let frames = ['|', '/', '-', '\\'];
            let mut n = 0;
            // Short prompts finish before anything is drawn.
            std::thread::sleep(Duration::from_millis(300));
            while !d.load(Ordering::SeqCst) {
                let walked = cancel.layers_walked().min(passes * layers);
                eprint!(
                    "\r\x1b[2K{} processing {prompt_tokens} prompt tokens: {:.0}% ({:.0} s; Ctrl-C stops)",
                    frames[n % 4],
                    100.0 * walked as f64 / (passes * layers).max(1) as f64,
                    t0.elapsed().as_secs_f64()
                );
                n += 1;
                std::thread::sleep(Duration::from_millis(120));
            }
            eprint!("\r\x1b[2K");
        });
        Spinner { done, thread: Some(thread) }
    }
    fn stop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Drops the oldest turns (a user message with its replies; never a system message) until the rendered conversation leaves
/// `room` tokens in `context`; returns how many messages went, or `None` if even the last
/// message alone does not fit.
fn trim_to_fit(history: &mut Vec<Message>, context: usize, room: usize, render: impl Fn(&[Message]) -> usize) -> Option<usize> {
    let mut dropped = 0;
    while render(history) + room > context {
        let first = history.iter().position(|m| m.role != Role::System)?;
        if history[first..].len() <= 1 {
            return None;
        }
        // A whole turn goes: the user's message and the replies to it.
        history.remove(first);
        dropped += 1;
        while history.len() > first + 1 && history[first].role != Role::User && history[first].role != Role::System {
            history.remove(first);
            dropped += 1;
        }
    }
    Some(dropped)
}

pub fn run_chat(a: ChatArgs) -> Result<()> {
    if !crate::say::quiet() {
        eprintln!("loading {} ...", a.model.model.display());
    }
    // Prompts run in chunks so that Ctrl-C, checked between layers, stops a long one within a
    // fraction of a second (the output is the same in any chunking: the kernels are
    // batch-invariant).
    let mut margs = a.model.clone();
    margs.prefill_chunk.get_or_insert(PROMPT_CHUNK);
    // The conversation's state is kept between turns.
    let model = margs.open_with(1, 1)?;
    let chat = model.chat()?;
    if !crate::say::quiet() {
        eprintln!("{HELP}");
    }
    let mut editor = rustyline::DefaultEditor::new()?;
    // After the editor: it takes SIGINT for itself when made (Ctrl-C at the prompt is a key in
    // its raw mode anyway); outside the prompt, Ctrl-C must stop the generation.
    let running = Running::default();
    let r = running.clone();
    ctrlc::set_handler(move || r.interrupt())?;
    // One seed for the conversation: each token's draw depends on it and the token's position.
    let sampling = a.sampling.sampling()?;
    let mut history: Vec<Message> = a.system.iter().map(|s| Message::new(Role::System, s.clone())).collect();
    let mut generator = deltafin::Generator::new(&model);
    let mut last_stats = None;
    // What /stats says about a reply that was stopped before it finished.
    let mut last_stopped: Option<String> = None;
    let context = model.new_sequence().context_limit();
    let layers = model.engine().model().config().num_layers as u64;
    let chunk = model.engine().options().prefill_chunk;
    let dim = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let tty_err = std::io::IsTerminal::is_terminal(&std::io::stderr());
    loop {
        let mut input = String::new();
        let mut prompt = "> ";
        loop {
            match editor.readline(prompt) {
                Ok(line) => {
                    if let Some(part) = line.strip_suffix('\\') {
                        input.push_str(part);
                        input.push('\n');
                        prompt = ". ";
                    } else {
                        input.push_str(&line);
                        break;
                    }
                }
                Err(ReadlineError::Interrupted) => {
                    eprintln!("(Ctrl-D or /quit leaves)");
                    input.clear();
                    prompt = "> ";
                }
                Err(ReadlineError::Eof) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
        let text = input.trim();
        if text.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(text);
        if let Some(cmd) = text.strip_prefix('/').filter(|c| !c.starts_with('/')) {
            match cmd {
                "quit" | "exit" => return Ok(()),
                "reset" | "clear" => {
                    history.retain(|m| m.role == Role::System);
                    generator.reset();
                    if cmd == "clear" && dim {
                        // Clear the screen and home the cursor.
                        print!("\x1b[2J\x1b[H");
                        let _ = std::io::Write::flush(&mut std::io::stdout());
                    }
                    eprintln!("(new conversation)");
                }
                "stats" => match (&last_stats, &last_stopped) {
                    (_, Some(note)) => eprintln!("{note}"),
                    (Some(s), None) => eprintln!("{}", deltafin::Stats::summary(s)),
                    (None, None) => eprintln!("(no reply yet)"),
                },
                "help" => eprintln!("{HELP}"),
                other => eprintln!("unknown command /{other}; /help lists them (start with // to send a line beginning with /)"),
            }
            continue;
        }
        // `//...` sends a line that begins with `/`.
        let content = if text.starts_with("//") { text[1..].to_string() } else { input.clone() };
        history.push(Message::new(Role::User, content));
        let render = |h: &[Message]| chat.render(h, None).map_or(usize::MAX / 2, |ids| ids.len());
        let room = a.max_new.min(context / 4).max(1);
        match trim_to_fit(&mut history, context, room, render) {
            Some(0) => {}
            Some(n) => eprintln!("(context full: the oldest {n} message(s) were dropped)"),
            None => {
                let n = history.pop().map(|m| chat.render(&[m], None).map_or(0, |i| i.len())).unwrap_or(0);
                eprintln!("(that message is {n} tokens, more than the context of {context} leaves room for; it was not sent)");
                continue;
            }
        }
        let ids = chat.render(&history, None)?;
        let cancel = running.start();
        let max_new = a.max_new.min(context.saturating_sub(ids.len())).max(1);
        let opts = margs.generate_options(max_new).stop_ids(chat.stop_ids()).cancel(cancel.clone()).sampling(sampling);
        let mut spinner = tty_err.then(|| Spinner::start(cancel.clone(), ids.len(), layers, chunk.unwrap_or(ids.len())));
        let mut split = ReplySplitter::new(model.tokenizer(), true, vec![]);
        let (mut produced, mut last_id, started) = (0usize, None, std::time::Instant::now());
        let mut out = std::io::stdout();
        let (mut answer, mut section) = (String::new(), None);
        let mut show = |parts: Vec<(ReplyPart, String)>, out: &mut std::io::Stdout| {
            for (p, t) in parts {
                if section != Some(p) {
                    let _ = match (p, dim) {
                        (ReplyPart::Reasoning, true) => write!(out, "\x1b[2m"),
                        (ReplyPart::Reasoning, false) => write!(out, "[thinking] "),
                        (ReplyPart::Content, true) if section.is_some() => writeln!(out, "\x1b[0m"),
                        (ReplyPart::Content, false) if section.is_some() => write!(out, "\n[answer] "),
                        _ => Ok(()),
                    };
                    section = Some(p);
                }
                if p == ReplyPart::Content {
                    answer.push_str(&t);
                }
                let _ = write!(out, "{t}");
            }
            let _ = out.flush();
        };
        // The generator resumes from the kept state where the new prompt extends it.
        let result = generator.generate(
            &ids,
            &opts,
            &mut OnToken(|s: Step<'_>| {
                if let Some(mut sp) = spinner.take() {
                    sp.stop();
                }
                produced += 1;
                last_id = Some(s.id);
                show(split.push(model.tokenizer(), s.id), &mut out);
                !running.interrupted()
            }),
        );
        drop(spinner);
        show(split.finish(), &mut out);
        running.end();
        if dim && section == Some(ReplyPart::Reasoning) {
            print!("\x1b[0m");
        }
        println!();
        last_stopped = None;
        match result {
            Ok(stats) => {
                let stopped = last_id.is_some_and(|id| chat.stop_ids().contains(&id));
                if !running.interrupted() && !stopped && stats.generated_tokens >= max_new {
                    eprintln!("(the reply was cut at {max_new} tokens: raise --max-new for longer replies)");
                }
                last_stats = Some(stats);
            }
            Err(deltafin::Error::Cancelled) => {}
            Err(e) => {
                eprintln!("error: {e}");
                generator.reset();
            }
        }
        if running.interrupted() {
            eprintln!("(stopped)");
            last_stopped = Some(format!(
                "the last reply was stopped with Ctrl-C after {produced} token(s) and {:.2} s, {}",
                started.elapsed().as_secs_f64(),
                if produced == 0 { "while its prompt was being read" } else { "before it finished" }
            ));
        }
        // The reply stays in the history (its think part is not replayed).
        history.push(Message::new(Role::Assistant, answer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trimming_drops_the_oldest_turns_and_keeps_system_messages() {
        let m = |r, t: &str| Message::new(r, t);
        let mut h = vec![m(Role::System, "sys"), m(Role::User, "aaaa"), m(Role::Assistant, "bbbb"), m(Role::User, "cc")];
        let len = |h: &[Message]| h.iter().map(|x| x.content.len()).sum::<usize>();
        assert_eq!(trim_to_fit(&mut h, 12, 2, len), Some(2));
        assert_eq!(h.iter().map(|x| x.content.as_str()).collect::<Vec<_>>(), ["sys", "cc"]);
        let mut h = vec![m(Role::User, "a very long message")];
        assert_eq!(trim_to_fit(&mut h, 5, 1, len), None);
    }
}
