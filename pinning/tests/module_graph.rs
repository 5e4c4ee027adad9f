//! The engine's modules import one way. This reads every `crate::`, `super::` and child-module
//! path in `src/` (comments and test modules left out), builds the graph of which module
//! uses which, and checks that it has no circle, that it is exactly the graph DESIGN.md
//! writes down, and that no source file has grown past 850 lines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

const MAX_LINES: usize = 850;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/pin/track.rs` is `pin::track`, `src/pin/mod.rs` is `pin`; the crate root is `lib`.
fn module_of(src: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(src).expect("under src/").with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The module that `first` (a path segment after `crate::`, or after `super::` or nothing
/// when `base` is given) names, if it is one of `modules`.
fn resolve(modules: &BTreeSet<String>, base: &str, first: &str, second: Option<&str>) -> Option<String> {
    let join = |a: &str, b: &str| if a.is_empty() { b.to_string() } else { format!("{a}::{b}") };
    let top = join(base, first);
    if !modules.contains(&top) {
        return None;
    }
    if let Some(second) = second {
        let nested = join(&top, second);
        if modules.contains(&nested) {
            return Some(nested);
        }
    }
    Some(top)
}

/// The code of a source file without comments, string contents or its trailing test module.
fn code_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && lines.peek().is_some_and(|l| l.trim_start().starts_with("mod tests {"))
        {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        let code = line.split("//").next().unwrap_or("");
        let mut kept = String::new();
        let mut in_string = false;
        for c in code.chars() {
            if c == '"' {
                in_string = !in_string;
            } else if !in_string {
                kept.push(c);
            }
        }
        out.push(kept);
    }
    out
}

/// The segments after each occurrence of `prefix` in `code`: `a::b` gives `(a, Some(b))`,
/// `{a, b::c}` gives each item.
fn paths_after<'a>(code: &'a str, prefix: &str) -> Vec<(&'a str, Option<&'a str>)> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().last();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            for item in inner.split(',') {
                let item = item.trim();
                let first = ident(item);
                let second = item[first.len()..].strip_prefix("::").map(ident);
                found.push((first, second));
            }
        } else {
            let first = ident(rest);
            let second = rest[first.len()..].strip_prefix("::").map(ident);
            found.push((first, second));
        }
    }
    found
}

fn actual_graph(src: &Path) -> (Graph, Vec<(PathBuf, usize)>) {
    let mut files = Vec::new();
    sources(src, &mut files);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(src, f)).filter(|m| m != "lib").collect();
    let mut graph = Graph::new();
    let mut lengths = Vec::new();
    for file in &files {
        let module = module_of(src, file);
        let text = std::fs::read_to_string(file).expect("a readable source");
        lengths.push((file.clone(), text.lines().count()));
        // The crate root declares and re-exports everything; test files use anything.
        if module == "lib" || module.rsplit("::").next().is_some_and(|last| last.starts_with("tests")) {
            continue;
        }
        let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
        let mut deps = BTreeSet::new();
        for code in code_lines(&text) {
            for (first, second) in paths_after(&code, "crate::") {
                deps.extend(resolve(&modules, "", first, second));
            }
            for (first, second) in paths_after(&code, "super::") {
                if first == "*" || first.is_empty() {
                    deps.insert(parent.to_string());
                } else {
                    deps.insert(
                        resolve(&modules, parent, first, second).unwrap_or_else(|| parent.to_string()),
                    );
                }
            }
            // A parent naming its own submodules: `plan::cut`, `use plan::{..}`.
            for child in modules.iter().filter_map(|m| m.strip_prefix(&format!("{module}::"))) {
                if !paths_after(&code, &format!("{child}::")).is_empty() {
                    deps.insert(format!("{module}::{child}"));
                }
            }
        }
        deps.retain(|d| d != &module && !d.is_empty());
        graph.insert(module, deps);
    }
    (graph, lengths)
}

/// The graph DESIGN.md writes down: lines `- `module`: `dep`, `dep`` (or `—`) between its
/// `<!-- module graph -->` and `<!-- end module graph -->` markers.
fn documented_graph(design: &str) -> Graph {
    let start = design.find("<!-- module graph -->").expect("DESIGN.md has the module graph");
    let end = design.find("<!-- end module graph -->").expect("DESIGN.md ends the module graph");
    let mut graph = Graph::new();
    for line in design[start..end].lines() {
        let Some(rest) = line.trim().strip_prefix("- `") else { continue };
        let (module, deps) = rest.split_once("`:").expect("- `module`: deps");
        let deps = deps
            .split(',')
            .map(|d| d.trim().trim_matches('`').to_string())
            .filter(|d| !d.is_empty() && d != "—");
        graph.insert(module.to_string(), deps.collect());
    }
    graph
}

/// A circle in `graph`, if it has one.
fn circle(graph: &Graph) -> Option<Vec<String>> {
    fn visit<'g>(
        graph: &'g Graph,
        node: &'g str,
        path: &mut Vec<&'g str>,
        done: &mut BTreeSet<&'g str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| *n == node) {
            return Some(path[at..].iter().map(|s| s.to_string()).chain([node.to_string()]).collect());
        }
        if done.contains(node) {
            return None;
        }
        path.push(node);
        for dep in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(graph, dep, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node);
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|node| visit(graph, node, &mut Vec::new(), &mut done))
}

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn modules_import_one_way_as_design_md_says() {
    let (graph, _) = actual_graph(&crate_dir().join("src"));
    if let Some(found) = circle(&graph) {
        panic!("import circle: {}", found.join(" -> "));
    }
    let design = std::fs::read_to_string(crate_dir().join("DESIGN.md")).expect("DESIGN.md");
    let documented = documented_graph(&design);
    if documented != graph {
        let show = |g: &Graph| {
            g.iter()
                .map(|(m, deps)| {
                    let deps: Vec<String> = deps.iter().map(|d| format!("`{d}`")).collect();
                    format!("- `{m}`: {}", if deps.is_empty() { "—".to_string() } else { deps.join(", ") })
                })
                .collect::<Vec<_>>()
                .join("\n")
        };
        panic!("DESIGN.md's module graph is not the code's; the code's is:\n{}", show(&graph));
    }
}

#[test]
fn no_source_file_is_longer_than_the_limit() {
    let (_, lengths) = actual_graph(&crate_dir().join("src"));
    let long: Vec<_> = lengths.iter().filter(|(_, n)| *n > MAX_LINES).collect();
    assert!(long.is_empty(), "files over {MAX_LINES} lines: {long:?}");
}

#[test]
fn the_circle_check_finds_a_circle() {
    let mut graph = Graph::new();
    graph.insert("a".into(), ["b".to_string()].into());
    graph.insert("b".into(), ["c".to_string()].into());
    graph.insert("c".into(), BTreeSet::new());
    assert_eq!(circle(&graph), None);
    graph.get_mut("c").expect("c").insert("a".into());
    assert_eq!(circle(&graph), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
}

#[test]
fn paths_are_read_from_code_not_comments_or_strings() {
    let lines =
        code_lines("use crate::a::b; // crate::c\n/// crate::d\nlet s = \"crate::e\";\nsuper::{f, g::h}\n");
    let all: Vec<_> = lines.iter().flat_map(|l| paths_after(l, "crate::")).collect();
    assert_eq!(all, vec![("a", Some("b"))]);
    let sup: Vec<_> = lines.iter().flat_map(|l| paths_after(l, "super::")).collect();
    assert_eq!(sup, vec![("f", None), ("g", Some("h"))]);
}
