//! Building the per-allocator binaries.
//!
//! The `workload` and `pairs` binaries are built in release once per `alloc-*` feature, in the
//! workspace's own target directory (so dependencies are compiled once and later runs are
//! incremental), and copied to `<target>/compare/bin/{workload,pairs}-<alloc>` because each
//! build overwrites `<target>/release/workload`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the binaries and reports of the harness live.
pub struct Bins {
    /// `<target>/compare`: reports go here by default.
    pub dir: PathBuf,
    /// The workspace root (for `git` and `cargo`).
    pub root: PathBuf,
}

impl Bins {
    /// The `workload` binary built for `alloc`.
    pub fn workload(&self, alloc: &str) -> PathBuf {
        self.dir.join("bin").join(format!("workload-{alloc}"))
    }

    /// The `pairs` binary built for `alloc`.
    pub fn pairs(&self, alloc: &str) -> PathBuf {
        self.dir.join("bin").join(format!("pairs-{alloc}"))
    }
}

/// The target directory: the driver itself runs from `<target>/<profile>/compare`.
fn target_dir() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find own path: {e}"))?;
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .ok_or_else(|| format!("unexpected location {}", exe.display()))
}

/// Builds (unless `build` is false) and locates the binaries of every allocator in `allocs`.
pub fn prepare(allocs: &[&str], build: bool) -> Result<Bins, String> {
    let target = target_dir()?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("no workspace root")?
        .to_path_buf();
    let bins = Bins {
        dir: target.join("compare"),
        root,
    };
    std::fs::create_dir_all(bins.dir.join("bin")).map_err(|e| e.to_string())?;
    for alloc in allocs {
        if build {
            eprintln!("== building workload and pairs with alloc-{alloc} (release)");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = Command::new(cargo)
                .current_dir(&bins.root)
                .env("CARGO_TARGET_DIR", &target)
                .args(["build", "--release", "--quiet", "-p", "compare"])
                .args(["--bin", "workload", "--bin", "pairs", "--features"])
                .arg(format!("alloc-{alloc}"))
                .status()
                .map_err(|e| format!("cannot run cargo: {e}"))?;
            if !status.success() {
                return Err(format!("building with alloc-{alloc} failed"));
            }
            for (name, dest) in [
                ("workload", bins.workload(alloc)),
                ("pairs", bins.pairs(alloc)),
            ] {
                let src = target.join("release").join(name);
                // Copy to a temporary name and rename, so a binary that is running is never
                // overwritten in place.
                let tmp = dest.with_extension("tmp");
                std::fs::copy(&src, &tmp)
                    .and_then(|_| std::fs::rename(&tmp, &dest))
                    .map_err(|e| format!("copying {} to {}: {e}", src.display(), dest.display()))?;
            }
        }
        for path in [bins.workload(alloc), bins.pairs(alloc)] {
            if !path.exists() {
                return Err(format!(
                    "{} is missing; run without --no-build",
                    path.display()
                ));
            }
        }
    }
    Ok(bins)
}

/// `git describe`-like identification of the tagalloc sources being measured: the short
/// commit, plus "+changes" when the work tree differs from it.
pub fn source_version(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .current_dir(root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(commit) = git(&["rev-parse", "--short=10", "HEAD"]) else {
        return "unknown (not a git checkout)".into();
    };
    let branch = git(&["rev-parse", "--abbrev-ref", "HEAD"]).unwrap_or_default();
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    format!(
        "{commit} ({branch}){}",
        if dirty { " +uncommitted changes" } else { "" }
    )
}
