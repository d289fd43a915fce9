//! The workspace's libraries and the modules of each, as the architecture
//! tests read them: from `cargo metadata` and the sources, so no list of
//! crates or modules goes stale.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

use super::walk;

/// Every workspace library's name and `src/` directory, from `cargo
/// metadata`: a crate added to the workspace is checked without editing a
/// list. The test-support crate (`lorafleet-tests`) is left out.
pub fn library_sources() -> Vec<(String, std::path::PathBuf)> {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success());
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut libs = Vec::new();
    for p in meta["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        if name == "lorafleet-tests" {
            continue;
        }
        for t in p["targets"].as_array().unwrap() {
            if t["kind"].as_array().unwrap().iter().any(|k| k == "lib") {
                let src = std::path::PathBuf::from(t["src_path"].as_str().unwrap());
                libs.push((name.to_owned(), src.parent().unwrap().to_path_buf()));
            }
        }
    }
    libs.sort();
    libs
}

/// The top-level modules of a crate's `src/` (a `NAME.rs` file or a `NAME/`
/// directory; binaries left out) and which others each one's non-test code
/// names as `crate::OTHER`.
pub fn module_graph(src: &std::path::Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut modules = BTreeSet::new();
    for entry in std::fs::read_dir(src).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_dir() {
            if name != "bin" {
                modules.insert(name);
            }
        } else if let Some(stem) = name.strip_suffix(".rs")
            && stem != "lib"
            && stem != "main"
        {
            modules.insert(stem.to_owned());
        }
    }
    let mut graph = BTreeMap::new();
    for m in &modules {
        let dir = src.join(m);
        let files = if dir.is_dir() {
            walk(&dir)
        } else {
            vec![src.join(format!("{m}.rs"))]
        };
        let mut uses = BTreeSet::new();
        for file in files
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "rs"))
        {
            let text = std::fs::read_to_string(file).unwrap();
            // A file's unit tests sit at its end; they may reach anywhere.
            // Comments (doc links) are not uses.
            let code: String = text
                .split("#[cfg(test)]\nmod tests")
                .next()
                .unwrap()
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let mut rest = code.as_str();
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let named: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                // `crate::{a, b}` names several.
                let names: Vec<String> = if named.is_empty() && rest.starts_with('{') {
                    let list = &rest[1..rest.find('}').unwrap_or(rest.len())];
                    list.split(',')
                        .filter_map(|p| p.trim().split("::").next())
                        .map(str::to_owned)
                        .collect()
                } else {
                    vec![named]
                };
                uses.extend(names.into_iter().filter(|n| n != m && modules.contains(n)));
            }
        }
        graph.insert(m.clone(), uses);
    }
    graph
}

/// A cycle in `graph`, as the modules along it, if there is one.
pub fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_owned());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_owned());
        for next in &graph[m] {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}
