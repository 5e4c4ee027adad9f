//! The shell commands README.md and docs/*.md show: every line of their ```sh blocks, and
//! every inline `umdev ...` span, cut into the simple commands a shell would run. Shared by
//! the binary's unit test (each `umdev` command parses) and tests/docs.rs (each one runs).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// One command line as a document shows it.
#[derive(Debug, Clone)]
pub struct DocLine {
    /// `README.md`, `docs/nvme.md`.
    pub file: String,
    /// 1-based.
    pub line: usize,
    /// The text, comment and line continuations resolved.
    pub text: String,
    /// An inline span in prose, not a line of a code block.
    pub inline: bool,
}

/// One simple command of a line: its words, and where its stdout goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Simple {
    /// The words, quotes removed.
    pub words: Vec<String>,
    /// `> PATH`.
    pub stdout_to: Option<String>,
    /// Ends with `&`.
    pub background: bool,
}

impl Simple {
    /// The program, past `VAR=value` assignments.
    pub fn program(&self) -> Option<&str> {
        self.words.iter().map(String::as_str).find(|w| !w.contains('=') || w.starts_with('-'))
    }

    /// The arguments of `umdev` (also spelled `cargo run --release --`), past `VAR=value`
    /// assignments, placeholders for a UUID (`<uuid>`, `UUID`, `5a1e4c36-...`) replaced by
    /// `uuid`; `None` for other programs.
    pub fn umdev_args(&self, uuid: &str) -> Option<Vec<String>> {
        let words: Vec<&str> = self
            .words
            .iter()
            .map(String::as_str)
            .skip_while(|w| w.contains('=') && !w.starts_with('-'))
            .collect();
        let rest = match words.as_slice() {
            ["umdev", rest @ ..] => rest,
            ["cargo", "run", "--release", "--", rest @ ..] => rest,
            _ => return None,
        };
        Some(
            rest.iter()
                .map(|w| match *w {
                    "<uuid>" | "UUID" | "5a1e4c36-..." => uuid.to_string(),
                    other => other.to_string(),
                })
                .collect(),
        )
    }
}

/// README.md and docs/*.md, under `root`.
pub fn documents(root: &Path) -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    docs.insert(0, root.join("README.md"));
    docs
}

/// Every command line of the documents under `root`.
pub fn lines(root: &Path) -> Vec<DocLine> {
    let mut out = Vec::new();
    for path in documents(root) {
        let file = path.strip_prefix(root).unwrap().display().to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        let mut fence: Option<String> = None;
        let mut pending: Option<(usize, String)> = None;
        for (i, line) in text.lines().enumerate() {
            let trimmed = line.trim_start();
            if let Some(lang) = trimmed.strip_prefix("```") {
                fence = if fence.is_some() { None } else { Some(lang.trim().to_string()) };
                continue;
            }
            match fence.as_deref() {
                Some("sh") => {
                    let (start, mut joined) = pending.take().unwrap_or((i + 1, String::new()));
                    let code = strip_comment(line);
                    if let Some(head) = code.trim_end().strip_suffix('\\') {
                        joined.push_str(head);
                        joined.push(' ');
                        pending = Some((start, joined));
                        continue;
                    }
                    joined.push_str(&code);
                    if !joined.trim().is_empty() {
                        out.push(DocLine {
                            file: file.clone(),
                            line: start,
                            text: joined.trim().to_string(),
                            inline: false,
                        });
                    }
                }
                Some(_) => {}
                None => {
                    for span in line.split('`').skip(1).step_by(2) {
                        if span.starts_with("umdev ") || span.starts_with("cargo run --release -- ") {
                            out.push(DocLine {
                                file: file.clone(),
                                line: i + 1,
                                text: span.to_string(),
                                inline: true,
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// `line` without a `# comment` (a `#` at the start or after a blank, outside quotes).
fn strip_comment(line: &str) -> String {
    let (mut single, mut double, mut prev) = (false, false, ' ');
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return line[..i].to_string(),
            _ => {}
        }
        prev = c;
    }
    line.to_string()
}

/// The simple commands of a line: words split as a shell splits them (quotes kept together),
/// cut at `|`, `&&`, `;` and a trailing `&`, with `> PATH` taken out.
pub fn simple_commands(text: &str) -> Vec<Simple> {
    let mut words: Vec<(String, bool)> = Vec::new();
    let (mut word, mut quoted, mut single, mut double, mut any) = (String::new(), false, false, false, false);
    for c in text.chars() {
        match c {
            '\'' if !double => {
                single = !single;
                quoted = true;
                any = true;
            }
            '"' if !single => {
                double = !double;
                quoted = true;
                any = true;
            }
            c if c.is_whitespace() && !single && !double => {
                if any {
                    words.push((std::mem::take(&mut word), quoted));
                }
                (quoted, any) = (false, false);
            }
            c => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push((word, quoted));
    }
    let mut out = Vec::new();
    let mut current = Simple { words: Vec::new(), stdout_to: None, background: false };
    let mut iter = words.into_iter();
    while let Some((w, quoted)) = iter.next() {
        match w.as_str() {
            "|" | "&&" | ";" | "&" if !quoted => {
                current.background = w == "&";
                out.push(std::mem::replace(
                    &mut current,
                    Simple { words: Vec::new(), stdout_to: None, background: false },
                ));
            }
            ">" if !quoted => current.stdout_to = iter.next().map(|(p, _)| p),
            _ => current.words.push(w),
        }
    }
    out.push(current);
    out.retain(|s| !s.words.is_empty());
    out
}
