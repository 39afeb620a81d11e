//! The house rules ARCHITECTURE.md states, checked on the sources: no file of the product
//! (`appliance/*/src`, tests excepted) is over 700 lines, and no crate's top-level modules
//! import each other in a circle (a module's `crate::<module>` paths outside comments and its
//! `#[cfg(test)]` part count as its imports).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The longest a product source file may be.
const MAX_LINES: usize = 700;

fn appliance() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../appliance")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Test code: a `tests` module or directory, `*_tests.rs`, `test_utils`, a fake.
fn is_test_file(rel: &Path) -> bool {
    rel.components().any(|c| {
        let c = c.as_os_str().to_string_lossy();
        let stem = c.trim_end_matches(".rs");
        stem == "tests" || stem == "test_utils" || stem.ends_with("_tests") || stem.starts_with("fake")
    })
}

fn crates() -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(appliance())
        .expect("appliance/")
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path().join("src")))
        .filter(|(_, src)| src.is_dir())
        .collect();
    out.sort();
    out
}

/// The product part of a source file: before its first `#[cfg(test)]`, comment lines dropped.
fn product_code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// `crate::<ident>` paths in `code`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `foo_crate::`, not ours
        }
        let ident: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if !ident.is_empty() {
            out.insert(ident);
        }
    }
    out
}

/// The strongly connected components of more than one node (Tarjan).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low[v];
                    self.low.insert(v, lv.min(lw));
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low[v];
                    self.low.insert(v, lv.min(iw));
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    comp.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.found.push(comp);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

#[test]
fn no_product_file_is_over_700_lines() {
    let mut long = Vec::new();
    for (name, src) in crates() {
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        for f in files {
            let rel = f.strip_prefix(&src).expect("under src");
            if is_test_file(rel) {
                continue;
            }
            let lines = std::fs::read_to_string(&f).expect("read").lines().count();
            if lines > MAX_LINES {
                long.push(format!("appliance/{name}/src/{}: {lines} lines", rel.display()));
            }
        }
    }
    assert!(long.is_empty(), "split these by job (at most {MAX_LINES} lines each):\n{}", long.join("\n"));
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    let mut found = Vec::new();
    for (name, src) in crates() {
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut modules = BTreeSet::new();
        for f in &files {
            let rel = f.strip_prefix(&src).expect("under src");
            if is_test_file(rel) {
                continue;
            }
            let first = rel.components().next().expect("a component").as_os_str().to_string_lossy().into_owned();
            let top = first.trim_end_matches(".rs").to_string();
            if matches!(top.as_str(), "lib" | "main") {
                continue;
            }
            modules.insert(top.clone());
            let code = product_code(&std::fs::read_to_string(f).expect("read"));
            graph.entry(top.clone()).or_default().extend(crate_paths(&code).into_iter().filter(|m| *m != top));
        }
        // Only edges to modules of this crate (not to items re-exported at its root).
        for deps in graph.values_mut() {
            deps.retain(|d| modules.contains(d));
        }
        for c in circles(&graph) {
            found.push(format!("{name}: {}", c.join(" ⇄ ")));
        }
    }
    assert!(found.is_empty(), "modules importing each other in a circle:\n{}", found.join("\n"));
}

#[test]
fn the_checker_finds_a_circle_and_reads_paths() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.insert("a".into(), ["b".to_string()].into());
    g.insert("b".into(), ["c".to_string()].into());
    g.insert("c".into(), ["a".to_string()].into());
    g.insert("d".into(), ["a".to_string()].into());
    assert_eq!(circles(&g), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
    let code = product_code("use crate::x::Y;\n// crate::z in a comment\nfoo_crate::w();\n#[cfg(test)]\nuse crate::t;");
    assert_eq!(crate_paths(&code), ["x".to_string()].into());
}
