//! `nvpool-agent --cacert`: a file that cannot be used stops the agent
//! before it starts anything, with one line naming the option and the
//! file, exit status 2.

use std::process::Command;

#[test]
fn an_unusable_cacert_is_a_usage_error() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let not_pem = dir.path().join("not-a-ca.pem");
    std::fs::write(&not_pem, "hello\n").unwrap();
    let run_dir = dir.path().join("run");
    for (file, why) in [
        ("/nonexistent/ca.pem", "cannot read it"),
        (not_pem.to_str().unwrap(), "no CERTIFICATE in it"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_nvpool-agent"))
            .args(["--cacert", file])
            .env("NVPOOL_RUN_DIR", &run_dir)
            .env("NVPOOL_LOG", "warn")
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{e}");
        assert!(e.contains(&format!("--cacert {file}: {why}")), "{e}");
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
        // Nothing was started: not even the run directory.
        assert!(!run_dir.exists());
    }
}
