//! Who may use the admin API: bearer tokens (ARCHITECTURE D7).
//!
//! ```text
//!   --admin-token-file PATH ──────────────┐
//!   else STATE_DIR/admin-token ───────────┤  (created 0600 with a random
//!   else a random token in memory ────────┤   256-bit token when missing)
//!                                         ▼
//!                                   AdminTokens ── check(presented) ◄── every admin request
//!                                         └─ current() ──► registration (the control plane's copy)
//! ```
//!
//! A token file holds one token per line; blank lines and lines starting
//! with `#` are skipped. Any line is accepted, so a token is rotated
//! without a gap: add the new one as the first line (the first is the one
//! the target gives the control plane when it registers, which it does
//! again when that changes), move the other clients to it, remove the old
//! line. The file is read again when it changes (looked at most once per
//! `ADMIN_TOKEN_RECHECK_MS`); a change that leaves it unreadable or
//! invalid keeps the tokens it had, with a warning.
//!
//! A token is never logged, never put in an error, never shown by `Debug`
//! ([`Secret`]); only the file's path is.

use crate::limits::{
    ADMIN_TOKENS_MAX, ADMIN_TOKEN_FILE_BYTES_MAX, ADMIN_TOKEN_RANDOM_BYTES, ADMIN_TOKEN_RECHECK_MS,
};
use crate::peerlog::peer_warn;
use nvpool_api::rest::Secret;
use nvpool_rt::lock;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The admin token file's name in the state directory.
pub const STATE_TOKEN_FILE: &str = "admin-token";

/// Why the admin tokens cannot be had. Never holds a token's text.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("admin token file {path}: cannot read it")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("admin token file {path}: cannot write it")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("admin token file {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

/// The tokens the admin API accepts. Clones share them (and their
/// reloads).
#[derive(Clone)]
pub struct AdminTokens {
    inner: Arc<Inner>,
}

struct Inner {
    /// Where they come from; None: fixed at start (generated in memory,
    /// or given by code).
    file: Option<PathBuf>,
    loaded: Mutex<Loaded>,
}

struct Loaded {
    /// At least one; the first is the current one.
    tokens: Vec<Secret>,
    /// What the file looked like when read (unchanged: not read again).
    stamp: Option<Stamp>,
    checked: Instant,
}

/// Enough of a file's metadata to notice it changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
        }
    }
}

impl std::fmt::Debug for AdminTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminTokens")
            .field("file", &self.inner.file)
            .field("tokens", &lock(&self.inner.loaded).tokens.len())
            .finish()
    }
}

impl AdminTokens {
    /// Fixed tokens (tests, embedding); at least one.
    pub fn fixed(tokens: Vec<Secret>) -> AdminTokens {
        assert!(!tokens.is_empty(), "the admin API needs a token");
        AdminTokens::new(None, tokens, None)
    }

    /// A random token that lives in memory only: only whoever this target
    /// tells (the control plane, by registering) can use the admin API.
    pub fn generated() -> AdminTokens {
        AdminTokens::fixed(vec![random_token()])
    }

    /// The tokens of `path`, read again when it changes.
    pub fn from_file(path: &Path) -> Result<AdminTokens, AuthError> {
        let (tokens, stamp) = read_file(path)?;
        warn_if_readable_by_others(path);
        Ok(AdminTokens::new(Some(path.to_owned()), tokens, Some(stamp)))
    }

    /// The tokens of `STATE_DIR/admin-token`, created (mode 0600) with a
    /// random token when missing, so the token outlives restarts.
    pub fn in_state_dir(dir: &Path) -> Result<AdminTokens, AuthError> {
        let path = dir.join(STATE_TOKEN_FILE);
        if !path.exists() {
            write_new_token_file(dir, &path)?;
            tracing::info!(file = %path.display(), "generated an admin API token");
        }
        AdminTokens::from_file(&path)
    }

    fn new(file: Option<PathBuf>, tokens: Vec<Secret>, stamp: Option<Stamp>) -> AdminTokens {
        AdminTokens {
            inner: Arc::new(Inner {
                file,
                loaded: Mutex::new(Loaded {
                    tokens,
                    stamp,
                    checked: Instant::now(),
                }),
            }),
        }
    }

    /// The file the tokens come from, if any.
    pub fn file(&self) -> Option<&Path> {
        self.inner.file.as_deref()
    }

    /// Whether `presented` is one of the tokens. Every token is compared
    /// whole, in time that depends on lengths only.
    pub fn check(&self, presented: &[u8]) -> bool {
        let loaded = self.refreshed();
        loaded
            .tokens
            .iter()
            .fold(false, |ok, t| t.matches(presented) | ok)
    }

    /// The token this target gives the control plane: the first one.
    pub fn current(&self) -> Secret {
        self.refreshed().tokens[0].clone()
    }

    /// The loaded tokens, read again first if the file changed since and
    /// was not looked at for `ADMIN_TOKEN_RECHECK_MS`.
    fn refreshed(&self) -> std::sync::MutexGuard<'_, Loaded> {
        let mut loaded = lock(&self.inner.loaded);
        let Some(path) = &self.inner.file else {
            return loaded;
        };
        if loaded.checked.elapsed().as_millis() < u128::from(ADMIN_TOKEN_RECHECK_MS) {
            return loaded;
        }
        loaded.checked = Instant::now();
        let stamp = std::fs::metadata(path).ok().map(|m| Stamp::of(&m));
        if stamp.is_some() && stamp == loaded.stamp {
            return loaded;
        }
        match read_file(path) {
            Ok((tokens, stamp)) => {
                if tokens.len() != loaded.tokens.len()
                    || tokens.iter().zip(&loaded.tokens).any(|(a, b)| a != b)
                {
                    tracing::info!(file = %path.display(), tokens = tokens.len(), "admin API tokens reloaded");
                }
                loaded.tokens = tokens;
                loaded.stamp = Some(stamp);
            }
            Err(e) => {
                // Requests reach this: rate-limited. The stamp stays, so
                // the file is tried again at the next check.
                peer_warn!(error = %e, "the admin token file changed and cannot be used; keeping the tokens read before");
            }
        }
        loaded
    }
}

/// A random token of `ADMIN_TOKEN_RANDOM_BYTES` (256 bits), in hex.
fn random_token() -> Secret {
    let mut text = String::with_capacity(2 * ADMIN_TOKEN_RANDOM_BYTES);
    while text.len() < 2 * ADMIN_TOKEN_RANDOM_BYTES {
        for b in crate::target::random_bytes() {
            text.push_str(&format!("{b:02x}"));
        }
    }
    text.truncate(2 * ADMIN_TOKEN_RANDOM_BYTES);
    Secret::new(text).expect("hex digits of the right length")
}

/// Reads and checks a token file.
fn read_file(path: &Path) -> Result<(Vec<Secret>, Stamp), AuthError> {
    let read_err = |source| AuthError::Read {
        path: path.to_owned(),
        source,
    };
    let invalid = |reason: String| AuthError::Invalid {
        path: path.to_owned(),
        reason,
    };
    let f = std::fs::File::open(path).map_err(read_err)?;
    let stamp = Stamp::of(&f.metadata().map_err(read_err)?);
    let mut bytes = Vec::new();
    f.take(ADMIN_TOKEN_FILE_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.len() as u64 > ADMIN_TOKEN_FILE_BYTES_MAX {
        return Err(invalid(format!(
            "longer than {ADMIN_TOKEN_FILE_BYTES_MAX} bytes"
        )));
    }
    let text = String::from_utf8(bytes).map_err(|_| invalid("not UTF-8 text".into()))?;
    let mut tokens = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // The reason never quotes the line: it is a token.
        let t = Secret::new(line).map_err(|e| invalid(format!("line {}: {e}", n + 1)))?;
        tokens.push(t);
    }
    if tokens.is_empty() {
        return Err(invalid("holds no token (one per line)".into()));
    }
    if tokens.len() > ADMIN_TOKENS_MAX {
        return Err(invalid(format!(
            "holds {} tokens; at most {ADMIN_TOKENS_MAX}",
            tokens.len()
        )));
    }
    Ok((tokens, stamp))
}

/// Creates `path` in `dir` holding one random token, readable by the
/// owner only: written to a temporary file created 0600, synced, renamed
/// into place, the directory synced.
fn write_new_token_file(dir: &Path, path: &Path) -> Result<(), AuthError> {
    let write_err = |source| AuthError::Write {
        path: path.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(write_err)?;
    let tmp = dir.join(format!("{STATE_TOKEN_FILE}.tmp"));
    // A temporary file a crash left may have any mode: start afresh.
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(write_err(e)),
    }
    let token = random_token();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(write_err)?;
    f.write_all(format!("{}\n", token.expose()).as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(write_err)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(write_err)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(write_err)?;
    Ok(())
}

fn warn_if_readable_by_others(path: &Path) {
    if let Ok(m) = std::fs::metadata(path) {
        if m.permissions().mode() & 0o077 != 0 {
            tracing::warn!(file = %path.display(), mode = format!("{:o}", m.permissions().mode() & 0o777),
                "the admin token file can be read by other users; chmod 600 it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn a_file_of_tokens_one_per_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokens");
        write(
            &p,
            "# comment\n\n  first-token-0123456789  \nsecond-token-0123456789\n",
        );
        let t = AdminTokens::from_file(&p).unwrap();
        assert!(t.check(b"first-token-0123456789"));
        assert!(t.check(b"second-token-0123456789"));
        assert!(!t.check(b"first-token-012345678"));
        assert!(!t.check(b"# comment"));
        assert!(!t.check(b""));
        assert_eq!(t.current().expose(), "first-token-0123456789");
        let dbg = format!("{t:?}");
        assert!(!dbg.contains("token-0123456789"), "{dbg}");
    }

    #[test]
    fn bad_files_are_refused_without_quoting_them() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokens");
        for text in [
            "",
            "# only a comment\n",
            "short\n",
            "a token with spaces inside\n",
        ] {
            write(&p, text);
            let e = AdminTokens::from_file(&p).unwrap_err().to_string();
            assert!(e.contains(&p.display().to_string()), "{e}");
            if let Some(line) = text.lines().next().filter(|l| !l.is_empty()) {
                assert!(!e.contains(line), "{e}");
            }
        }
        let many: String = (0..=ADMIN_TOKENS_MAX)
            .map(|i| format!("token-number-{i:04}-abcdef\n"))
            .collect();
        write(&p, &many);
        assert!(AdminTokens::from_file(&p).is_err());
        assert!(AdminTokens::from_file(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn rotation_reloads_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokens");
        write(&p, "old-token-0123456789\n");
        let t = AdminTokens::from_file(&p).unwrap();
        // The new token first, the old one still accepted.
        write(&p, "new-token-0123456789abc\nold-token-0123456789\n");
        std::thread::sleep(std::time::Duration::from_millis(
            ADMIN_TOKEN_RECHECK_MS + 20,
        ));
        assert!(t.check(b"new-token-0123456789abc"));
        assert!(t.check(b"old-token-0123456789"));
        assert_eq!(t.current().expose(), "new-token-0123456789abc");
        // The old one removed.
        write(&p, "new-token-0123456789abc\n");
        std::thread::sleep(std::time::Duration::from_millis(
            ADMIN_TOKEN_RECHECK_MS + 20,
        ));
        assert!(!t.check(b"old-token-0123456789"));
        // A broken edit keeps what was there.
        write(&p, "oops\n");
        std::thread::sleep(std::time::Duration::from_millis(
            ADMIN_TOKEN_RECHECK_MS + 20,
        ));
        assert!(t.check(b"new-token-0123456789abc"));
    }

    #[test]
    fn the_state_dir_token_is_created_private_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let a = AdminTokens::in_state_dir(&state).unwrap();
        let path = state.join(STATE_TOKEN_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.trim().len(), 2 * ADMIN_TOKEN_RANDOM_BYTES);
        assert!(text.trim().bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(a.check(text.trim().as_bytes()));
        assert_eq!(a.file(), Some(path.as_path()));
        // The next start reuses it.
        let b = AdminTokens::in_state_dir(&state).unwrap();
        assert_eq!(a.current(), b.current());
        // Generated tokens differ.
        assert_ne!(
            AdminTokens::generated().current(),
            AdminTokens::generated().current()
        );
    }
}
