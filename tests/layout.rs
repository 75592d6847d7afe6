//! The layout of `src/` is the architecture: folders in layers, each using only the layers below
//! it (lib.rs lists them), and files a newcomer can read. This reads the sources; no GPU needed.

use std::path::{Path, PathBuf};

/// The layers, lowest first: a module may use its own layer and those before it.
const LAYERS: [&str; 7] = ["error", "model", "io", "gpu", "cache", "engine", "serve"];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn layer_of(name: &str) -> Option<usize> {
    LAYERS.iter().position(|l| *l == name)
}

#[test]
fn no_module_uses_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        if rel == "lib.rs" {
            continue;
        }
        let own = rel.split('/').next().unwrap().trim_end_matches(".rs");
        let own_layer = layer_of(own).unwrap_or_else(|| panic!("src/{rel}: {own} is in no layer of LAYERS"));
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            // what the code uses; a doc link may name anything
            let code = line.split("//").next().unwrap();
            for (i, _) in code.match_indices("crate::") {
                let name: String =
                    code[i + 7..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                match layer_of(&name) {
                    Some(l) if l > own_layer => wrong.push(format!("src/{rel}:{}: uses crate::{name}", n + 1)),
                    Some(_) => {}
                    // lib.rs keeps one path for each module: its folder's (`crate::io::gguf`)
                    None => wrong.push(format!("src/{rel}:{}: crate::{name} is not a folder of src/", n + 1)),
                }
            }
        }
    }
    assert!(wrong.is_empty(), "imports that run up a layer (order: {LAYERS:?}):\n{}", wrong.join("\n"));
}

/// A file does one thing: none in the library or the command is over 700 lines.
#[test]
fn no_source_file_is_over_700_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    sources(&root.join("cli/src"), &mut files);
    let long: Vec<String> = files
        .iter()
        .map(|f| (f, std::fs::read_to_string(f).unwrap().lines().count()))
        .filter(|(_, n)| *n > 700)
        .map(|(f, n)| format!("{}: {n} lines", f.display()))
        .collect();
    assert!(files.len() > 60, "only {} sources found", files.len());
    assert!(long.is_empty(), "split these by concern: {long:?}");
}

/// The test profiles of `.config/nextest.toml` pick tests by exact name. A renamed test would
/// quietly drop out of the forced-variant runs (profile `variants`), so every name there must be
/// a test that exists.
#[test]
fn every_test_the_nextest_profiles_name_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = std::fs::read_to_string(root.join(".config/nextest.toml")).unwrap();
    let mut files = Vec::new();
    sources(&root.join("tests"), &mut files);
    sources(&root.join("src"), &mut files);
    let code: String = files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect();
    let mut named = 0;
    for piece in config.split("test(=").skip(1) {
        let name = &piece[..piece.find(')').expect("test(= closes")];
        assert!(code.contains(&format!("fn {name}(")), ".config/nextest.toml names `{name}`, which is no test");
        named += 1;
    }
    for piece in config.split("binary(").skip(1) {
        let name = &piece[..piece.find(')').expect("binary( closes")];
        assert!(root.join(format!("tests/{name}.rs")).exists(), ".config/nextest.toml names binary `{name}`");
    }
    assert!(named > 30, "only {named} tests named: is the config read?");
}
