//! Architecture invariants that the dependency graph must keep. Each one is
//! stated in ARCHITECTURE.md; this test makes it fail loudly when broken.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

#[path = "support/modules.rs"]
mod modules;
use modules::{find_cycle, library_sources, module_graph};

/// Crates that open sockets or speak a network protocol.
const NETWORK_CRATES: &[&str] = &[
    "tokio", "mio", "hyper", "h2", "tonic", "axum", "reqwest", "sqlx", "redis", "socket2",
];

/// Crates that encode or generate the wire format.
const WIRE_CRATES: &[&str] = &[
    "prost",
    "prost-build",
    "tonic-prost",
    "tonic-prost-build",
    "protox",
];

struct Graph {
    /// Package id -> (name, direct normal dependency ids).
    nodes: BTreeMap<String, (String, Vec<String>)>,
    /// Workspace member name -> id.
    members: BTreeMap<String, String>,
}

/// The host's target triple, so metadata covers only the packages built here.
fn host_triple() -> String {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("run rustc -vV");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .expect("rustc -vV prints the host triple")
}

fn graph() -> Graph {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--offline",
            "--filter-platform",
        ])
        .arg(host_triple())
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: BTreeMap<String, String> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["id"].as_str().unwrap().to_owned(),
                p["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let mut nodes = BTreeMap::new();
    for node in meta["resolve"]["nodes"].as_array().unwrap() {
        let id = node["id"].as_str().unwrap().to_owned();
        // Only normal (non-dev, non-build) edges: what ships in the library.
        let deps = node["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| {
                d["dep_kinds"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|k| k["kind"].is_null())
            })
            .map(|d| d["pkg"].as_str().unwrap().to_owned())
            .collect();
        nodes.insert(id.clone(), (names[&id].clone(), deps));
    }
    let members = meta["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| {
            let id = id.as_str().unwrap().to_owned();
            (names[&id].clone(), id)
        })
        .collect();
    Graph { nodes, members }
}

impl Graph {
    fn transitive_names(&self, member: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![self.members[member].clone()];
        let mut names = BTreeSet::new();
        while let Some(id) = stack.pop() {
            if !seen.insert(id.clone()) {
                continue;
            }
            let (name, deps) = &self.nodes[&id];
            names.insert(name.clone());
            stack.extend(deps.iter().cloned());
        }
        names
    }

    fn direct_names(&self, member: &str) -> BTreeSet<String> {
        self.nodes[&self.members[member]]
            .1
            .iter()
            .map(|id| self.nodes[id].0.clone())
            .collect()
    }
}

/// The crates of `list` that `deps` holds.
fn found<'a>(list: &[&'a str], deps: &BTreeSet<String>) -> Vec<&'a str> {
    list.iter().copied().filter(|c| deps.contains(*c)).collect()
}

#[test]
fn the_engine_does_no_network_io() {
    let g = graph();
    let found = found(NETWORK_CRATES, &g.transitive_names("lorafleet-engine"));
    assert!(
        found.is_empty(),
        "lorafleet-engine must not depend on network crates, found {found:?}"
    );
}

/// Crates that compute: GPU bindings, tokenizers, thread pools, the engine.
const COMPUTE_CRATES: &[&str] = &["cudarc", "tokenizers", "rayon", "gemm", "lorafleet-engine"];

/// The admin CLI links no server code: it speaks the admin API through the
/// shared body types alone.
#[test]
fn lorafleetctl_links_no_server() {
    // `cargo tree` resolves features for this package alone, as building
    // it does (the workspace-wide metadata unifies the gateway's `sqlx`
    // feature of the shared types into every user).
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "-p",
            "lorafleetctl",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--locked",
            "--offline",
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deps: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    assert!(deps.len() > 20, "the tree was read: {deps:?}");
    let g = graph();
    for server in [
        "lorafleet-gateway",
        "sqlx",
        "axum",
        "redis",
        "tonic",
        "lorafleet-engine",
    ] {
        assert!(!deps.contains(server), "lorafleetctl depends on {server}");
    }
    assert!(deps.contains("lorafleet-admin-types"));
    // The gateway reads and writes the same types.
    assert!(
        g.direct_names("lorafleet-gateway")
            .contains("lorafleet-admin-types")
    );
}

#[test]
fn the_gateway_and_the_artifact_rules_need_no_engine() {
    let g = graph();
    for member in ["lorafleet-gateway", "lorafleet-artifact"] {
        let found = found(COMPUTE_CRATES, &g.transitive_names(member));
        assert!(
            found.is_empty(),
            "{member} must not depend on compute crates (checking artifacts needs \
             lorafleet-artifact only), found {found:?}"
        );
    }
    // The artifact rules are pure file parsing: no network either.
    let network = found(NETWORK_CRATES, &g.transitive_names("lorafleet-artifact"));
    assert!(network.is_empty(), "lorafleet-artifact: {network:?}");
    // Both sides share it, so they apply one set of rules.
    for member in ["lorafleet-gateway", "lorafleet-engine"] {
        assert!(
            g.direct_names(member).contains("lorafleet-artifact"),
            "{member} uses lorafleet-artifact"
        );
    }
}

#[test]
fn only_proto_knows_the_wire_format() {
    let g = graph();
    for member in g.members.keys().filter(|m| m.as_str() != "lorafleet-proto") {
        let found = found(WIRE_CRATES, &g.direct_names(member));
        assert!(
            found.is_empty(),
            "{member} depends on wire crates {found:?}; go through lorafleet-proto"
        );
    }
    let root = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let proto_files: Vec<_> = walk(&root)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "proto"))
        .collect();
    assert!(!proto_files.is_empty());
    for p in proto_files {
        let relative = p.strip_prefix(&root).unwrap();
        assert!(
            relative.starts_with("proto"),
            "{} lies outside proto/",
            p.display()
        );
    }
}

/// In the gateway, only `upstream/` knows the wire: every other module
/// speaks the domain types it converts to, so a change of the wire touches
/// one folder.
#[test]
fn only_upstream_knows_the_wire_in_the_gateway() {
    let src = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../gateway/src"));
    let upstream = src.join("upstream");
    let mut checked = 0;
    for file in walk(&src) {
        if file.extension().is_none_or(|e| e != "rs") || file.starts_with(&upstream) {
            continue;
        }
        checked += 1;
        let text = std::fs::read_to_string(&file).unwrap();
        for needle in ["lorafleet_proto", "tonic::", "pb::"] {
            assert!(
                !text.contains(needle),
                "{} uses {needle}; wire types stay in gateway/src/upstream/",
                file.display()
            );
        }
    }
    assert!(checked > 20, "the gateway's sources were found ({checked})");
    assert!(
        walk(&upstream).iter().any(|f| std::fs::read_to_string(f)
            .unwrap()
            .contains("lorafleet_proto")),
        "upstream/ is where the wire is converted"
    );
}

/// In the worker, wire messages are built only in `convert.rs`: the
/// service passes domain values to it (the generated trait's signatures
/// name wire types, so a use alone is allowed; a struct literal is not).
#[test]
fn only_convert_builds_wire_messages_in_the_worker() {
    let src = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../worker/src"));
    let mut checked = 0;
    for file in walk(&src) {
        if file.extension().is_none_or(|e| e != "rs")
            || file.components().any(|c| c.as_os_str() == "convert")
        {
            continue;
        }
        checked += 1;
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("pb::") {
                let path: String = rest[at + 4..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                let after = &rest[at + 4 + path.len()..];
                // `-> pb::X {` opens a function body, not a struct literal.
                let return_type = rest[..at].trim_end().ends_with("->");
                assert!(
                    (return_type || !after.starts_with(" {"))
                        && !path.contains("generate_event::Event::"),
                    "{}:{}: builds pb::{path}; wire messages are built in worker/src/convert/",
                    file.display(),
                    n + 1
                );
                rest = after;
            }
        }
    }
    assert!(checked >= 5, "the worker's sources were found ({checked})");
}

/// `anyhow` only where an error ends: in binaries (`src/bin/`, `main.rs`)
/// and tests. Library code returns typed errors that say what failed.
#[test]
fn anyhow_only_in_binaries_and_tests() {
    let root = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut checked = 0;
    for krate in [
        "gateway",
        "worker",
        "worker/engine",
        "artifact",
        "tls",
        "telemetry",
        "proto",
    ] {
        let src = root.join(krate).join("src");
        let bin = src.join("bin");
        for file in walk(&src) {
            if file.extension().is_none_or(|e| e != "rs")
                || file.starts_with(&bin)
                || file.ends_with("main.rs")
            {
                continue;
            }
            checked += 1;
            let text = std::fs::read_to_string(&file).unwrap();
            // Unit tests at the end of a file may use it.
            let library = text.split("#[cfg(test)]").next().unwrap_or_default();
            assert!(
                !library.contains("anyhow"),
                "{} uses anyhow; library code returns typed errors",
                file.display()
            );
        }
    }
    assert!(checked > 60, "the sources were found ({checked})");
}

/// One adapter id type and one residency type, defined in
/// `lorafleet-domain` and used by the gateway, the worker and the engine:
/// no other crate defines its own.
#[test]
fn one_adapter_id_and_one_residency_type() {
    let root = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut checked = 0;
    for krate in ["gateway", "worker", "worker/engine", "artifact"] {
        for file in walk(&root.join(krate).join("src")) {
            if file.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            checked += 1;
            let text = std::fs::read_to_string(&file).unwrap();
            for needle in ["enum Residency", "type AdapterId", "struct AdapterId"] {
                assert!(
                    !text.contains(needle),
                    "{} defines `{needle}`; it is lorafleet_domain's",
                    file.display()
                );
            }
        }
    }
    assert!(checked > 60, "the sources were found ({checked})");
    let domain = std::fs::read_to_string(root.join("domain/src/lib.rs")).unwrap();
    assert!(domain.contains("pub struct AdapterId(NonZeroU64)"));
    assert!(domain.contains("pub enum Residency"));
}

fn walk(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if name == "target" || name == ".git" {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out
}

/// Uses that close a module cycle today, each with why it is there; the
/// test fails once one is gone, so the list only shrinks.
const KNOWN_BACK_EDGES: &[(&str, &str, &str, &str)] = &[(
    "lorafleet-engine",
    "lora",
    "backend",
    "the host tier packs expert LoRA factors in the CPU backend's panel layout \
     (`backend/cpu/panels`), so a slot write copies without repacking",
)];

/// Every library's top-level modules form layers: none reaches back into
/// a module that reaches it (the rollout controller once called into the
/// admin plane that called it). The crates come from `cargo metadata`.
#[test]
fn no_module_cycle_in_any_library() {
    let libs = library_sources();
    let names: Vec<&str> = libs.iter().map(|(n, _)| n.as_str()).collect();
    for must in [
        "lorafleet-gateway",
        "lorafleet-worker",
        "lorafleet-engine",
        "lorafleet-store",
    ] {
        assert!(names.contains(&must), "{must} is not among {names:?}");
    }
    for (name, src) in &libs {
        let mut graph = module_graph(src);
        for &(krate, from, to, why) in KNOWN_BACK_EDGES {
            if krate == name {
                let edges = graph.get_mut(from).unwrap();
                assert!(
                    edges.remove(to),
                    "{krate}: {from} -> {to} is gone; take it off KNOWN_BACK_EDGES ({why})"
                );
            }
        }
        if let Some(cycle) = find_cycle(&graph) {
            panic!("{name}: a module cycle: {}", cycle.join(" -> "));
        }
    }
    let root = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    for (src, expected) in [
        (
            "gateway/src",
            &["admin", "api", "rollout", "router", "upstream"][..],
        ),
        (
            "worker/src",
            &["convert", "refusal", "runtime", "service"][..],
        ),
    ] {
        let graph = module_graph(&root.join(src));
        for m in expected {
            assert!(graph.contains_key(*m), "{src}: module {m} was not found");
        }
        assert!(
            graph.values().map(BTreeSet::len).sum::<usize>() >= expected.len(),
            "{src}: the modules' uses were found: {graph:?}"
        );
        if let Some(cycle) = find_cycle(&graph) {
            panic!("{src}: a module cycle: {}", cycle.join(" -> "));
        }
    }
    // The check finds a cycle when there is one.
    let mut g = BTreeMap::new();
    g.insert("a".to_owned(), BTreeSet::from(["b".to_owned()]));
    g.insert("b".to_owned(), BTreeSet::from(["a".to_owned()]));
    assert_eq!(
        find_cycle(&g),
        Some(vec!["a".to_owned(), "b".to_owned(), "a".to_owned()])
    );
}

/// The error argument of every `Result<T, E>` written in `code`, with the
/// line it is on.
fn result_error_types(code: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("Result<") {
        let start = from + at + "Result<".len();
        let (mut depth, mut comma, mut end) = (1, None, None);
        for (i, c) in code[start..].char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' | ')' | ']' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(start + i);
                        break;
                    }
                }
                ',' if depth == 1 => comma = Some(start + i),
                _ => {}
            }
        }
        if let (Some(comma), Some(end)) = (comma, end) {
            let line = code[..start].lines().count();
            out.push((line, code[comma + 1..end].trim().to_owned()));
        }
        from = start;
    }
    out
}

/// Library code returns typed errors, never `Result<_, String>`: a caller
/// can match a variant, a message cannot be matched without parsing it.
/// Binaries, tests, benchmarks and the test-support crate may.
#[test]
fn no_string_errors_in_library_code() {
    let mut checked = 0;
    let mut found = Vec::new();
    let libs = library_sources();
    assert!(
        libs.iter().any(|(n, _)| n == "lorafleet-store"),
        "the crates came from cargo metadata: {libs:?}"
    );
    for (_, src) in libs {
        for file in walk(&src) {
            if file.extension().is_none_or(|e| e != "rs")
                || file.components().any(|c| c.as_os_str() == "bin")
            {
                continue;
            }
            checked += 1;
            let text = std::fs::read_to_string(&file).unwrap();
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
            for (line, error) in result_error_types(code) {
                if error == "String" || error == "std::string::String" {
                    found.push(format!("{}:{line}", file.display()));
                }
            }
        }
    }
    assert!(checked > 100, "the sources were found ({checked})");
    assert!(
        found.is_empty(),
        "Result<_, String> in library code: {found:#?}"
    );
    // The scan sees through nesting, and finds what it must.
    assert_eq!(
        result_error_types("fn f() -> Result<Vec<(u8, u16)>, String> {}"),
        vec![(1, "String".to_owned())]
    );
    assert_eq!(
        result_error_types("type R = std::result::Result<T, E>;"),
        vec![(1, "E".to_owned())]
    );
}

/// Every path ARCHITECTURE.md names exists: a path from the repository
/// root, or, inside a code-map row or an invariant about one folder, a
/// path that ends a real one (`backend/cpu/amx.rs`).
#[test]
fn architecture_md_names_only_paths_that_exist() {
    let root = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut known = BTreeSet::new();
    for file in walk(&root) {
        let rel = file
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let parts: Vec<&str> = rel.split('/').collect();
        for i in 1..parts.len() {
            known.insert(format!("{}/", parts[..i].join("/")));
        }
        known.insert(rel);
    }
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let mut checked = 0;
    let mut stale = Vec::new();
    for (i, quoted) in text.split('`').enumerate() {
        // Odd pieces are inside backticks.
        let path = quoted.split("::").next().unwrap();
        let looks_like_path = i % 2 == 1
            && path.contains('/')
            && !path.starts_with('/')
            && path
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c));
        if !looks_like_path {
            continue;
        }
        checked += 1;
        let found = known.contains(path) || known.iter().any(|k| k.ends_with(&format!("/{path}")));
        if !found {
            stale.push(path.to_owned());
        }
    }
    assert!(
        checked > 100,
        "ARCHITECTURE.md's paths were read ({checked})"
    );
    assert!(
        stale.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {stale:?}"
    );
}

/// The non-test functions of `src` longer than `max` lines, as
/// `file::name (lines)`. A function runs from its `fn` line to the first
/// line at its indentation that closes it (rustfmt's layout).
fn long_functions(src: &std::path::Path, max: usize) -> Vec<String> {
    let mut out = Vec::new();
    for file in walk(src) {
        if file.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
        let lines: Vec<&str> = code.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let line = lines[i];
            let body = line.trim_start();
            let indent = line.len() - body.len();
            let head = ["pub ", "pub(crate) ", "pub(super) ", "async ", "const "]
                .iter()
                .fold(body, |b, p| b.strip_prefix(p).unwrap_or(b));
            let head = head.strip_prefix("async ").unwrap_or(head);
            if let Some(rest) = head.strip_prefix("fn ")
                && !line.trim_end().ends_with(';')
            {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let close = format!("{}}}", " ".repeat(indent));
                let end = (i + 1..lines.len())
                    .find(|&j| lines[j].starts_with(&close))
                    .unwrap_or(lines.len() - 1);
                let n = end - i + 1;
                if n > max {
                    let rel = file.strip_prefix(src).unwrap().display().to_string();
                    out.push(format!("{rel}::{name} ({n})"));
                }
                i = end;
            }
            i += 1;
        }
    }
    out.sort();
    out
}

/// No gateway function outside tests runs over 120 lines, but the one
/// exhaustive mapping of API errors, and no gateway file over 800.
#[test]
fn gateway_functions_and_files_stay_short() {
    let src = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../gateway/src"));
    let long: Vec<String> = long_functions(&src, 120)
        .into_iter()
        .filter(|f| !f.starts_with("api/error.rs::parts "))
        .collect();
    assert!(
        long.is_empty(),
        "gateway functions over 120 lines: {long:?}"
    );
    for file in walk(&src) {
        let lines = std::fs::read_to_string(&file).map_or(0, |t| t.lines().count());
        assert!(lines <= 800, "{} has {lines} lines", file.display());
    }
    // The measure finds a long function.
    let dir = tempfile::tempdir().unwrap();
    let body = "    let x = 1;\n".repeat(130);
    std::fs::write(
        dir.path().join("a.rs"),
        format!("pub async fn big() {{\n{body}}}\n"),
    )
    .unwrap();
    assert_eq!(long_functions(dir.path(), 120), vec!["a.rs::big (132)"]);
}

/// The admin plane has one core: only `admin/core.rs` checks a role,
/// begins or commits a transaction and writes `admin_changes`; the HTTP
/// handlers (`admin/http.rs`) and the console call `exec`/`read` and never
/// build a request body or reach the admin API over HTTP.
#[test]
fn the_admin_plane_changes_through_its_core_alone() {
    let root = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../gateway/src"));
    // (files, banned there); `Role` itself (admin/mod.rs) defines `allows`.
    let rules: &[(&str, &[&str])] = &[
        (
            "admin/",
            &[".begin()", ".commit()", "INSERT INTO admin_changes"],
        ),
        ("admin/http.rs", &["sqlx::", "Transaction"]),
        ("console/", &["/admin/v1/", "oneshot", "Bearer "]),
        ("", &[".allows("]),
    ];
    let mut found = Vec::new();
    let mut checked = 0;
    for file in walk(&root) {
        let rel = file
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if !rel.ends_with(".rs") || rel == "admin/core.rs" {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        for (scope, banned) in rules {
            if !rel.starts_with(scope) || (scope.is_empty() && rel == "admin/mod.rs") {
                continue;
            }
            checked += 1;
            for b in *banned {
                if code.contains(b) {
                    found.push(format!("{rel}: {b}"));
                }
            }
        }
    }
    assert!(checked > 20, "the sources were found ({checked})");
    assert!(found.is_empty(), "outside the admin core: {found:#?}");
    let core = std::fs::read_to_string(root.join("admin/core.rs")).unwrap();
    for needed in [
        ".allows(",
        ".begin()",
        ".commit()",
        "INSERT INTO admin_changes",
    ] {
        assert!(core.contains(needed), "admin/core.rs lacks {needed}");
    }
}
