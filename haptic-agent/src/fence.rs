//! The durable fence: the highest fencing epoch this agent accepted and the leader identity
//! that holds it, kept in one file written with write, fsync, rename and a directory fsync,
//! so it survives a crash or restart.

use std::{
    fs,
    io::Write as _,
    path::{Path, PathBuf},
};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The fence file exists but does not hold an epoch. The agent refuses to guess.
    #[error("fence file {path} is corrupt: {content:?}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Its first bytes.
        content: String,
    },
    /// Reading or writing the fence file failed.
    #[error("fence file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The fence: the highest epoch accepted, and the leader identity that holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fence {
    /// The highest epoch accepted.
    pub epoch: u64,
    /// The leader that applied under `epoch` first; none in a fence file written before the
    /// identity was recorded (the next apply at that epoch records its own).
    pub leader: Option<String>,
}

/// The fence file: the epoch as a canonical decimal u64 and a newline, then optionally the
/// leader identity as a JSON string and a newline (a file of the first form alone, as older
/// agents wrote it, still loads). A missing file means fence 0 with no holder.
#[derive(Debug, Clone)]
pub struct FenceFile {
    path: PathBuf,
}

impl FenceFile {
    /// The fence kept at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the fence's epoch: 0 when the file does not exist, an error when it is corrupt.
    pub fn load(&self) -> Result<u64> {
        self.load_fence().map(|fence| fence.epoch)
    }

    /// Reads the fence: epoch 0 and no holder when the file does not exist, an error when it
    /// is not in the format above.
    pub fn load_fence(&self) -> Result<Fence> {
        let bytes = match fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Fence::default());
            }
            Err(source) => {
                return Err(Error::Io {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.strip_suffix('\n'))
            .and_then(|text| {
                let (digits, leader) = match text.split_once('\n') {
                    Some((digits, holder)) => {
                        // A JSON string holds no raw newline: exactly one line.
                        let holder = serde_json::from_str::<String>(holder).ok()?;
                        (digits, Some(holder))
                    }
                    None => (text, None),
                };
                // Only canonical decimals: what `store` writes and nothing else.
                let canonical = !digits.is_empty()
                    && digits.bytes().all(|b| b.is_ascii_digit())
                    && (digits == "0" || !digits.starts_with('0'));
                let epoch = canonical.then(|| digits.parse::<u64>().ok()).flatten()?;
                Some(Fence { epoch, leader })
            })
            .ok_or_else(|| Error::Corrupt {
                path: self.path.clone(),
                content: String::from_utf8_lossy(&bytes[..bytes.len().min(64)]).into_owned(),
            })
    }

    /// Durably records `epoch` with no holder (see [`FenceFile::store_fence`]).
    pub fn store(&self, epoch: u64) -> Result<()> {
        self.store_fence(&Fence {
            epoch,
            leader: None,
        })
    }

    /// Durably records `fence`: writes a temporary file beside the fence, fsyncs it, renames
    /// it over the fence and fsyncs the directory.
    pub fn store_fence(&self, fence: &Fence) -> Result<()> {
        let io = |source| Error::Io {
            path: self.path.clone(),
            source,
        };
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let tmp = self.path.with_extension("tmp");
        let mut text = format!("{}\n", fence.epoch);
        if let Some(leader) = &fence.leader {
            // Serializing a string cannot fail.
            text.push_str(&serde_json::to_string(leader).unwrap_or_default());
            text.push('\n');
        }
        let mut file = fs::File::create(&tmp).map_err(io)?;
        // From here on a failure leaves no `fence.tmp` behind.
        let written = file
            .write_all(text.as_bytes())
            .and_then(|()| file.sync_all())
            .and_then(|()| {
                drop(file);
                fs::rename(&tmp, &self.path)
            });
        if let Err(error) = written {
            let _ = fs::remove_file(&tmp);
            return Err(io(error));
        }
        fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_is_zero_and_stored_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fence = FenceFile::new(dir.path().join("fence"));
        assert_eq!(fence.load().expect("missing"), 0);
        fence.store(42).expect("store");
        assert_eq!(fence.load().expect("load"), 42);
        fence.store(u64::MAX).expect("store max");
        assert_eq!(fence.load().expect("load max"), u64::MAX);
        assert!(!dir.path().join("fence.tmp").exists());
    }

    #[test]
    fn a_failed_fence_write_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A directory where the fence should be: the rename over it fails.
        std::fs::create_dir_all(dir.path().join("fence/x")).expect("mkdir");
        let fence = FenceFile::new(dir.path().join("fence"));
        assert!(fence.store(7).is_err());
        assert!(!dir.path().join("fence.tmp").exists(), "fence.tmp was left");
    }

    #[test]
    fn the_holder_is_kept_and_an_old_file_without_it_loads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fence = FenceFile::new(dir.path().join("fence"));
        fs::write(fence.path(), "9\n").expect("old format");
        assert_eq!(
            fence.load_fence().expect("old format loads"),
            Fence {
                epoch: 9,
                leader: None
            }
        );
        let held = Fence {
            epoch: 10,
            leader: Some("haptic-0 \"odd\"\nname".to_owned()),
        };
        fence.store_fence(&held).expect("store");
        assert_eq!(fence.load_fence().expect("load"), held);
        assert_eq!(fence.load().expect("epoch"), 10);
    }

    #[test]
    fn anything_but_a_canonical_epoch_is_corrupt() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fence = FenceFile::new(dir.path().join("fence"));
        for bad in [
            "",
            "\n",
            "12",
            "x\n",
            "-1\n",
            "012\n",
            "1 \n",
            "99999999999999999999\n",
            "7\nleader\n",
            "7\n\"leader\"",
            "7\n\"a\"\n\"b\"\n",
            "7\n\n",
        ] {
            fs::write(fence.path(), bad).expect("write");
            assert!(
                matches!(fence.load(), Err(Error::Corrupt { .. })),
                "{bad:?} should be corrupt"
            );
        }
    }
}
