//! A real S3-compatible server for the tests: `s3s-fs` (the s3s project's
//! server over a directory), which `.ci/run` installs. Each test starts its
//! own on a loopback port over a directory of its own: a bucket is a
//! directory under it and an object a file, so a test can change or delete
//! an object behind the server's back, as someone with write access to
//! the bucket would.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const ACCESS_KEY: &str = "lorafleet-test-access";
pub const SECRET_KEY: &str = "lorafleet-test-secret-key-0123456789";

/// A running `s3s-fs`; stopped on drop.
#[derive(Debug)]
pub struct S3Server {
    child: Child,
    root: tempfile::TempDir,
    pub endpoint: String,
}

/// The `s3s-fs` binary: `LORAFLEET_S3S_FS`, else on the PATH.
pub fn s3s_fs_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("LORAFLEET_S3S_FS") {
        return PathBuf::from(path);
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("s3s-fs"))
                .find(|p| p.is_file())
        })
        .expect(
            "s3s-fs is not installed: `cargo install --locked s3s-fs@0.14.1 --features binary` \
             (.ci/run does), or set LORAFLEET_S3S_FS",
        )
}

impl S3Server {
    /// Starts a server with the given buckets, and waits until it answers.
    pub fn start(buckets: &[&str]) -> S3Server {
        let root = tempfile::tempdir().expect("the store's directory");
        for b in buckets {
            std::fs::create_dir_all(root.path().join(b)).expect("a bucket");
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(s3s_fs_binary())
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(root.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start s3s-fs");
        let server = S3Server {
            child,
            root,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "s3s-fs did not listen on {port} within 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    /// The file behind object `key` of `bucket`.
    pub fn object_file(&self, bucket: &str, key: &str) -> PathBuf {
        self.root.path().join(bucket).join(key)
    }

    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// What a client of this server needs in its environment: the
    /// credentials (the AWS chain's variables) and the region.
    pub fn client_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
