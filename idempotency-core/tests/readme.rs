//! The Rust snippets of the README and of the guides in `docs/` compile as doctests of
//! this crate (`ReadmeDoctests` and the guides' items in `lib.rs`; the Iceberg guide's in
//! `idempotency-iceberg`), where every dependency
//! of this crate is in scope. A user who copies a snippet into a new service has only the
//! crates the README tells them to add, so this test checks that no snippet names another
//! crate (`http::…` without the `idempotency_core::http` re-export failed that way, E0433).

use std::collections::BTreeSet;

/// What a user of the README has: the crates it tells them to add, and the framework.
const A_USERS_CRATES: [&str; 15] = [
    "std",
    "axum",
    "hyper",      // the plain hyper screen's server
    "hyper_util", // and what serves it
    "tokio",
    "tower",
    "tower_layer",
    "sqlx",
    "idempotency_core",
    "idempotency_store_memory",
    "idempotency_store_sql",
    "idempotency_store_redis",
    "idempotency_iceberg", // the profile crates, which the README tells an Iceberg
    "idempotency_grpc",    // catalog or a gRPC server to add
    "http", // only as `idempotency_core::http::{self, …}` brings it in (checked below)
];

fn rust_blocks(markdown: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (number, line) in markdown.lines().enumerate() {
        let fence = line.trim_start().starts_with("```");
        match current.take() {
            None if fence && line.contains("```rust") && !line.contains("ignore") => {
                current = Some((number + 2, String::new()));
            }
            None => {}
            Some(block) if fence => blocks.push(block),
            Some((start, mut text)) => {
                text.push_str(line);
                text.push('\n');
                current = Some((start, text));
            }
        }
    }
    blocks
}

/// `code` without what `::{…}` groups hold (`use axum::{extract::Request}` keeps
/// `use axum::{}`): the paths inside are relative to the group's root.
fn without_use_groups(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut depth = 0usize;
    let mut rest = code;
    while let Some(c) = rest.chars().next() {
        if depth == 0 && rest.starts_with("::{") {
            out.push_str("::{");
            rest = &rest[3..];
            depth = 1;
            continue;
        }
        if depth > 0 {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                out.push('}');
            }
        } else {
            out.push(c);
        }
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// The first segment of every path in `code` (`http` in `http::Method`), skipping
/// method turbofish (`.get::<T>`) and nested segments (`a::b::c` gives `a`).
fn path_roots(code: &str) -> BTreeSet<String> {
    let code = &without_use_groups(code);
    let bytes = code.as_bytes();
    let mut roots = BTreeSet::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts_ident = (bytes[i].is_ascii_lowercase() || bytes[i] == b'_')
            && (i == 0
                || !(bytes[i - 1].is_ascii_alphanumeric()
                    || matches!(bytes[i - 1], b'_' | b':' | b'.')));
        if starts_ident {
            let end = i + code[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(code.len() - i);
            if code[end..].starts_with("::") && !code[end..].starts_with("::<") {
                roots.insert(code[i..end].to_owned());
            }
            i = end;
        } else {
            i += 1;
        }
    }
    roots
}

/// README.md and every guide in `docs/`, each with its text.
fn pages() -> Vec<(String, String)> {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut names = vec!["README.md".to_owned()];
    let mut guides: Vec<String> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|entry| {
            entry
                .expect("docs/ entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    guides.sort();
    names.extend(guides);
    names
        .into_iter()
        .map(|name| {
            let text = std::fs::read_to_string(root.join(&name)).expect(&name);
            (name, text)
        })
        .collect()
}

#[test]
fn readme_snippets_name_only_crates_a_user_has() {
    for (page, text) in pages() {
        let blocks = rust_blocks(&text);
        if page == "README.md" {
            assert!(blocks.len() >= 3, "no Rust snippets found in README.md");
        }
        page_snippets_name_only_crates_a_user_has(&page, blocks);
    }
}

fn page_snippets_name_only_crates_a_user_has(page: &str, blocks: Vec<(usize, String)>) {
    for (line, code) in blocks {
        let brings_http = code.contains("idempotency_core::http::{self");
        for root in path_roots(&code) {
            let allowed = A_USERS_CRATES.contains(&root.as_str())
                || matches!(root.as_str(), "self" | "crate" | "super")
                // primitive types' associated items (`str::to_owned`)
                || matches!(root.as_str(), "str" | "u8" | "u16" | "u32" | "u64" | "usize" | "i64" | "f64" | "bool" | "char")
                // a module the snippet itself declares, or brings in with `use x::{root::{self, …}}`
                || code.contains(&format!("mod {root}"))
                || code.contains(&format!("{root}::{{self"));
            assert!(
                allowed,
                "{page} snippet at line {line} names the crate `{root}`, which a user copying it does not have:\n{code}"
            );
            if root == "http" {
                assert!(
                    brings_http,
                    "{page} snippet at line {line} uses `http::` without `use idempotency_core::http::{{self, …}}`:\n{code}"
                );
            }
        }
    }
}
