//! Man pages and shell completions, generated from the clap definition of [`super::Cli`]
//! (issue 32) into `dist/man/` (`cairn.1` and one page per subcommand, `cairn-inspect-log.1`
//! and so on) and `dist/completions/` (bash, zsh, fish), which the .deb installs.
//!
//! How: the files are committed, and the test below regenerates them and fails when the
//! committed ones differ (`CAIRN_WRITE_DOCS=1` on it writes them), as
//! `docs/configuration.md` is held to the table of config keys. Why not the other ways:
//! - a hidden `cairn` subcommand would put `clap_mangen` and `clap_complete` into the
//!   binary every box runs, for files written once per release, and `cargo deb` has no step
//!   that runs the built binary before it packs the assets;
//! - a build script cannot see the CLI definition without compiling `src/cli` (and the
//!   config, and what that imports) a second time, for the build machine;
//! - an xtask binary needs a step of its own before `cargo deb`, which a packager forgets.
//!
//! Committed files need no step at all, show a CLI change's effect on its man page in the
//! diff, and keep both generators dev-dependencies.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::CommandFactory;
use clap_complete::Shell;

/// Every generated file, by its path under `dist/`.
fn generate() -> BTreeMap<PathBuf, Vec<u8>> {
    let dir = tempfile::tempdir().expect("temp dir");
    let man = dir.path().join("man");
    let completions = dir.path().join("completions");
    std::fs::create_dir_all(&man).unwrap();
    std::fs::create_dir_all(&completions).unwrap();
    clap_mangen::generate_to(super::Cli::command(), &man).expect("man pages");
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut super::Cli::command(), "cairn", &completions)
            .expect("completions");
    }
    files_under(dir.path())
}

fn files_under(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    for sub in ["man", "completions"] {
        let Ok(entries) = std::fs::read_dir(root.join(sub)) else {
            continue;
        };
        for e in entries.flatten() {
            let rel = Path::new(sub).join(e.file_name());
            out.insert(rel, std::fs::read(e.path()).unwrap());
        }
    }
    out
}

/// The subcommands, each as its man page's name: `cairn-inspect`, `cairn-inspect-log`, ...
fn command_paths() -> Vec<(String, String)> {
    fn walk(cmd: &clap::Command, prefix: &str, out: &mut Vec<(String, String)>) {
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            if sub.get_name() == "help" {
                continue;
            }
            let page = format!("{prefix}-{}", sub.get_name());
            out.push((page.clone(), sub.get_name().to_string()));
            walk(sub, &page, out);
        }
    }
    let mut out = Vec::new();
    walk(&super::Cli::command(), "cairn", &mut out);
    out
}

#[test]
fn the_man_pages_and_completions_in_dist_are_what_the_cli_generates() {
    let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("dist");
    let want = generate();
    if std::env::var_os("CAIRN_WRITE_DOCS").is_some() {
        for sub in ["man", "completions"] {
            let _ = std::fs::remove_dir_all(dist.join(sub));
            std::fs::create_dir_all(dist.join(sub)).unwrap();
        }
        for (rel, bytes) in &want {
            std::fs::write(dist.join(rel), bytes).unwrap();
        }
    }
    let have = files_under(&dist);
    let names = |m: &BTreeMap<PathBuf, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&have),
        names(&want),
        "dist/ holds other files than the CLI generates: run `CAIRN_WRITE_DOCS=1 cargo test \
         --all-features --lib generated` and commit dist/"
    );
    for (rel, bytes) in &want {
        assert!(
            have[rel] == *bytes,
            "dist/{} differs from what the CLI generates: run `CAIRN_WRITE_DOCS=1 cargo test \
             --all-features --lib generated` and commit dist/",
            rel.display()
        );
    }
}

#[test]
fn every_command_has_a_man_page_and_a_completion_in_each_shell() {
    let files = generate();
    let text = |rel: &str| String::from_utf8(files[Path::new(rel)].clone()).unwrap();
    let paths = command_paths();
    assert!(paths.len() >= 15, "{paths:?}");
    for (page, name) in &paths {
        let man = format!("man/{page}.1");
        assert!(files.contains_key(Path::new(&man)), "no {man}");
        assert!(text(&man).contains(name.as_str()), "{man}");
        for shell in [
            "completions/cairn.bash",
            "completions/_cairn",
            "completions/cairn.fish",
        ] {
            assert!(text(shell).contains(name.as_str()), "{name} not in {shell}");
        }
    }
    for flag in [
        "--config",
        "--json",
        "--offline",
        "--repair",
        "--reset-pipeline",
        "--latest",
    ] {
        assert!(text("completions/cairn.bash").contains(flag), "{flag}");
    }
    let top = text("man/cairn.1");
    assert!(
        top.contains("CAIRN_CONFIG"),
        "the environment variable is documented"
    );
    assert!(top.contains("Exit status"), "{top}");
}
