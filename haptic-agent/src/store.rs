//! The data directory: staged sets, complete sets, and the `current` and `last-known-good`
//! symlinks swapped by atomic rename.
//!
//! ```text
//! <data>/fence                  the fence (see `fence`)
//! <data>/staging/<name>/...     a set being written and checked; leftovers are removed at start
//! <data>/sets/<name>/...        complete sets; <name>.json beside each holds its metadata
//! <data>/trees/<id>/...         large directories of sets (>= TREE_MIN_FILES files, such as
//!                               2,500 certificates), shared: a set's `certs` is then a symlink
//!                               `../../trees/<id>`, and a set whose `certs` did not change
//!                               links the same tree instead of hard-linking every file again
//! <data>/current -> sets/<name>            what HAProxy runs (`-C <data>/current`)
//! <data>/last-known-good -> sets/<name>    the set live before it, restored when a load fails
//! ```

use std::{
    collections::BTreeMap,
    fs,
    io::Write as _,
    os::unix::fs::{
        DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
    },
    path::{Path, PathBuf},
};

use haptic_agent_client::{FileSet, Form};
use serde::{Deserialize, Serialize};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file-system operation failed.
    #[error("{action} {path}")]
    Io {
        /// What the store was doing.
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file in a set directory has a name that is not UTF-8 or is not a regular file.
    #[error("unexpected entry {0} in a set directory")]
    Unexpected(PathBuf),
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What the file system says of one file of a complete set, taken when the agent knew its
/// content (it wrote or hard-linked the file, or read it): writing to the file moves its
/// modification time (and usually its size), replacing it changes its inode. A complete set's
/// files are never modified, so a stamp that still matches vouches for the content without
/// reading it; one that moved sends the agent back to the content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    inode: u64,
    len: u64,
    modified_ns: i128,
}

impl Stamp {
    fn of(metadata: &fs::Metadata) -> Self {
        Self {
            inode: metadata.ino(),
            len: metadata.len(),
            modified_ns: i128::from(metadata.mtime()) * 1_000_000_000
                + i128::from(metadata.mtime_nsec()),
        }
    }
}

/// The stamps of a set's files, by path.
pub type Stamps = BTreeMap<String, Stamp>;

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// What the agent records beside a complete set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetMeta {
    /// The set's checksum as sent and verified.
    pub checksum: String,
    /// The sender's generation.
    pub generation: u64,
    /// The sender's identity.
    pub leader: String,
    /// The sender's epoch.
    pub epoch: u64,
    /// The set's files, as written: the live checksum is recomputed over exactly these, so
    /// what HAProxy writes beside them at run time (a unix socket, a pidfile) never changes
    /// what the agent reports live. Empty in metadata written by older agents: every regular
    /// file of the set's directory is read then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
}

/// The name of the symlink HAProxy runs from.
pub const CURRENT: &str = "current";
/// The name of the symlink to the set restored on a failed load.
pub const LAST_KNOWN_GOOD: &str = "last-known-good";

/// The agent's data directory.
///
/// A set holds private keys: its files are created 0600 and its directories 0700 (owned by
/// the agent), or, when HAProxy runs as another user ([`SetStore::open_shared`]), 0640 and
/// 0750 with that user's group, so HAProxy can read them and not change them.
#[derive(Debug, Clone)]
pub struct SetStore {
    root: PathBuf,
    group: Option<u32>,
}

impl SetStore {
    /// Opens (creating) the data directory at `root`, which must be absolute, and removes
    /// staging leftovers of an interrupted apply. Sets are readable by the agent's user only.
    pub fn open(root: &Path) -> Result<Self> {
        Self::open_shared(root, None)
    }

    /// Like [`SetStore::open`], and when `group` is given, the data directory, `sets`,
    /// `staging` and every set are readable (not writable) by that group: HAProxy's, when it
    /// runs as an unprivileged user.
    pub fn open_shared(root: &Path, group: Option<u32>) -> Result<Self> {
        let store = Self {
            root: root.to_path_buf(),
            group,
        };
        if group.is_some() {
            store.restrict(root, true)?;
        }
        for dir in ["sets", "staging", TREES] {
            let path = root.join(dir);
            fs::create_dir_all(&path).map_err(io("creating", &path))?;
            // Directories made by older agents were 0755.
            store.restrict(&path, true)?;
        }
        let staging = root.join("staging");
        for entry in fs::read_dir(&staging).map_err(io("listing", &staging))? {
            let path = entry.map_err(io("listing", &staging))?.path();
            fs::remove_dir_all(&path).map_err(io("removing", &path))?;
        }
        // Trees only staging leftovers used.
        store.remove_unused_trees()?;
        Ok(store)
    }

    /// The modes of a set's directories and files.
    fn modes(&self) -> (u32, u32) {
        match self.group {
            Some(_) => (0o750, 0o640),
            None => (0o700, 0o600),
        }
    }

    /// Gives `path` the store's group (if any) and mode, for a directory or a file.
    fn restrict(&self, path: &Path, dir: bool) -> Result<()> {
        let (dir_mode, file_mode) = self.modes();
        if let Some(gid) = self.group {
            std::os::unix::fs::chown(path, None, Some(gid))
                .map_err(io("changing the group of", path))?;
        }
        let mode = if dir { dir_mode } else { file_mode };
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .map_err(io("changing the mode of", path))
    }

    fn create_dir(&self, path: &Path) -> Result<()> {
        fs::DirBuilder::new()
            .mode(self.modes().0)
            .create(path)
            .map_err(io("creating", path))?;
        if self.group.is_some() {
            self.restrict(path, true)?;
        }
        Ok(())
    }

    /// The data directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<data>/current`, the path HAProxy is started with.
    pub fn current_path(&self) -> PathBuf {
        self.root.join(CURRENT)
    }

    /// The directory of set `name`.
    pub fn set_dir(&self, name: &str) -> PathBuf {
        self.root.join("sets").join(name)
    }

    /// The name of the set a link (`current` or `last-known-good`) points to.
    pub fn link(&self, link: &str) -> Result<Option<String>> {
        let path = self.root.join(link);
        match fs::read_link(&path) {
            Ok(target) => Ok(target
                .file_name()
                .and_then(|name| name.to_str())
                .map(str::to_owned)),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(io("reading link", &path)(error)),
        }
    }

    /// Points `link` at set `name` atomically (a new symlink renamed over the old one), or
    /// removes it when `name` is none; then fsyncs the data directory.
    pub fn set_link(&self, link: &str, name: Option<&str>) -> Result<()> {
        let path = self.root.join(link);
        match name {
            Some(name) => {
                let tmp = self.root.join(format!(".{link}.tmp"));
                let _ = fs::remove_file(&tmp);
                std::os::unix::fs::symlink(Path::new("sets").join(name), &tmp)
                    .map_err(io("creating link", &tmp))?;
                fs::rename(&tmp, &path).map_err(io("renaming link", &path))?;
            }
            None => match fs::remove_file(&path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(io("removing link", &path)(error)),
            },
        }
        sync_dir(&self.root)
    }

    /// Writes `files` into a fresh staging directory (each file and directory fsynced) and
    /// returns its name and path. Nothing outside `<data>/staging` is touched.
    pub fn stage(&self, files: &FileSet, checksum: &str) -> Result<(String, PathBuf)> {
        let (name, dir) = self.write_staged(files, checksum)?;
        if let Err(error) = self.sync_staged(&name) {
            let _ = self.discard_staged(&name);
            return Err(error);
        }
        Ok((name, dir))
    }

    /// Writes `files` into a fresh staging directory, without fsync, and returns its name and
    /// path. A write that fails half-way removes the directory. The set must go through
    /// [`SetStore::sync_staged`] before [`SetStore::promote`]: the agent runs that fsync while
    /// `haproxy -c` reads the files, since the check needs them in the page cache, not on disk.
    pub fn write_staged(&self, files: &FileSet, checksum: &str) -> Result<(String, PathBuf)> {
        self.write_staged_reusing(files, checksum, None, |_| false)
    }

    /// [`SetStore::write_staged`], except that every file for which `unchanged` holds is
    /// hard-linked from complete set `base` (whose files are `base_files`) rather than
    /// written: a complete set's files are never modified, and linking 2,500 certificates
    /// takes a fraction of writing and fsyncing them again. The caller vouches that those
    /// files are identical in `base`.
    ///
    /// A top-level directory of at least [`TREE_MIN_FILES`] files is a tree (see the module
    /// documentation): when `base` has it as a tree and every one of its files is unchanged,
    /// the new set links the same tree (one symlink where there were 2,500 hard links, 35 ms
    /// of system time at 10,000 Ingresses); otherwise a new tree is written (unchanged files
    /// hard-linked from `base`).
    pub fn write_staged_reusing(
        &self,
        files: &FileSet,
        checksum: &str,
        base: Option<(&str, &FileSet)>,
        unchanged: impl Fn(&str) -> bool,
    ) -> Result<(String, PathBuf)> {
        let base_dir = base.map(|(base, _)| self.set_dir(base));
        let name = format!(
            "{}-{:016x}",
            &checksum[..checksum.len().min(16)],
            rand::random::<u64>()
        );
        let dir = self.root.join("staging").join(&name);
        self.create_dir(&dir)?;
        // Any failure below removes the half-written directory (and the trees made for it).
        let mut guard = RemoveOnDrop(Some(dir.clone()), Vec::new());
        let mut dirs = std::collections::BTreeSet::new();
        let mut shared = std::collections::BTreeSet::new();
        for (top, count) in top_dirs(files) {
            if count < TREE_MIN_FILES {
                continue;
            }
            dirs.insert(top.to_owned());
            let link = dir.join(top);
            let reused = base
                .zip(base_dir.as_ref())
                .and_then(|((_, base_files), base_dir)| {
                    let tree = tree_of(&base_dir.join(top))?;
                    let same = top_dirs(base_files).get(top) == Some(&count)
                        && under(files, top).all(&unchanged);
                    same.then_some(tree)
                });
            let tree = match reused {
                Some(tree) => {
                    shared.insert(top.to_owned());
                    tree
                }
                None => format!("{:016x}", rand::random::<u64>()),
            };
            // The link first: a removal of unused trees never sees this one unused.
            std::os::unix::fs::symlink(Path::new("../..").join(TREES).join(&tree), &link)
                .map_err(io("creating link", &link))?;
            if !shared.contains(top) {
                let path = self.root.join(TREES).join(&tree);
                self.create_dir(&path)?;
                guard.1.push(path);
            }
        }
        // The trees written afresh, with their base's directory: the unchanged files at their
        // top are linked by name between the two opened directories (`linkat`), not by two
        // whole paths each resolved through a set's link (2,500 certificates for one rotated).
        let mut tree_dirs = std::collections::BTreeMap::new();
        if let Some(base) = &base_dir {
            for top in dirs.iter().filter(|top| !shared.contains(*top)) {
                let opened = fs::File::open(dir.join(top))
                    .and_then(|new| Ok((new, fs::File::open(base.join(top))?)));
                if let Ok(pair) = opened {
                    tree_dirs.insert(top.clone(), pair);
                }
            }
        }
        for (path, content) in files.iter() {
            if path
                .split_once('/')
                .is_some_and(|(top, _)| shared.contains(top))
            {
                continue;
            }
            if let Some((top, name)) = path.split_once('/')
                && !name.contains('/')
                && let Some((new, old)) = tree_dirs.get(top)
                && unchanged(path)
            {
                rustix::fs::linkat(old, name, new, name, rustix::fs::AtFlags::empty())
                    .map_err(std::io::Error::from)
                    .map_err(io("linking", &dir.join(path)))?;
                continue;
            }
            // Paths were validated by the protocol: relative, no `..`, no empty component.
            let target = dir.join(path);
            for (i, _) in path.match_indices('/') {
                if dirs.insert(path[..i].to_owned()) {
                    let created = dir.join(&path[..i]);
                    if !created.is_dir() {
                        self.create_dir(&created)?;
                    }
                }
            }
            if let Some(base) = &base_dir
                && unchanged(path)
            {
                let source = base.join(path);
                fs::hard_link(&source, &target).map_err(io("linking", &target))?;
                continue;
            }
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(self.modes().1)
                .open(&target)
                .map_err(io("creating", &target))?;
            if let Some(gid) = self.group {
                std::os::unix::fs::fchown(&file, None, Some(gid))
                    .map_err(io("changing the group of", &target))?;
            }
            file.write_all(content).map_err(io("writing", &target))?;
        }
        guard.0 = None;
        guard.1.clear();
        Ok((name, dir))
    }

    /// Fsyncs every file and directory of staging set `name`, each directory after its
    /// entries, so that the set is durable before it is promoted and linked.
    pub fn sync_staged(&self, name: &str) -> Result<()> {
        sync_tree(&self.root.join("staging").join(name), "", &|_| false)
    }

    /// [`SetStore::sync_staged`] for a set written by [`SetStore::write_staged_reusing`]:
    /// the files for which `linked` holds are hard links to files already durable, so only
    /// the directories that name them are fsynced, not the files again (an fsync each, on
    /// 2,500 certificates, would be seconds of journal commits).
    pub fn sync_staged_reusing(&self, name: &str, linked: impl Fn(&str) -> bool) -> Result<()> {
        sync_tree(&self.root.join("staging").join(name), "", &linked)
    }

    /// Moves a checked staging directory into `sets/` and records its metadata beside it.
    pub fn promote(&self, name: &str, meta: &SetMeta) -> Result<()> {
        let from = self.root.join("staging").join(name);
        let to = self.set_dir(name);
        fs::rename(&from, &to).map_err(io("moving", &from))?;
        self.write_meta(name, meta)
    }

    /// Records `meta` beside set `name`, atomically (a temporary file fsynced and renamed over
    /// it, then the directory fsynced).
    pub fn write_meta(&self, name: &str, meta: &SetMeta) -> Result<()> {
        let meta_path = self.meta_path(name);
        let tmp = self.root.join("sets").join(format!(".{name}.json.tmp"));
        let written = (|| {
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io("creating", &tmp))?;
            // Serializing a plain struct of strings and integers cannot fail.
            file.write_all(&serde_json::to_vec(meta).unwrap_or_default())
                .map_err(io("writing", &tmp))?;
            file.sync_all().map_err(io("syncing", &tmp))?;
            fs::rename(&tmp, &meta_path).map_err(io("renaming", &meta_path))
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written?;
        sync_dir(&self.root.join("sets"))
    }

    /// Removes a staging directory (a set that failed its check).
    pub fn discard_staged(&self, name: &str) -> Result<()> {
        let dir = self.root.join("staging").join(name);
        fs::remove_dir_all(&dir).map_err(io("removing", &dir))
    }

    fn meta_path(&self, name: &str) -> PathBuf {
        self.root.join("sets").join(format!("{name}.json"))
    }

    /// The metadata recorded for set `name`, if readable.
    pub fn meta(&self, name: &str) -> Option<SetMeta> {
        let bytes = fs::read(self.meta_path(name)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Removes every set but those named in `keep`.
    pub fn retain(&self, keep: &[&str]) -> Result<()> {
        let sets = self.root.join("sets");
        for entry in fs::read_dir(&sets).map_err(io("listing", &sets))? {
            let path = entry.map_err(io("listing", &sets))?.path();
            let Some(file_name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let set = file_name.strip_suffix(".json").unwrap_or(file_name);
            if keep.contains(&set) {
                continue;
            }
            let removed = if path.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            removed.map_err(io("removing", &path))?;
        }
        self.remove_unused_trees()
    }

    /// Removes the trees no set (complete or staging) links.
    fn remove_unused_trees(&self) -> Result<()> {
        let mut used = std::collections::BTreeSet::new();
        for parent in ["sets", "staging"] {
            let parent = self.root.join(parent);
            for set in fs::read_dir(&parent).map_err(io("listing", &parent))? {
                let set = set.map_err(io("listing", &parent))?.path();
                if !set.is_dir() {
                    continue;
                }
                for entry in fs::read_dir(&set).map_err(io("listing", &set))? {
                    let entry = entry.map_err(io("listing", &set))?;
                    if entry.file_type().is_ok_and(|kind| kind.is_symlink())
                        && let Some(tree) = tree_of(&entry.path())
                    {
                        used.insert(tree);
                    }
                }
            }
        }
        let trees = self.root.join(TREES);
        for entry in fs::read_dir(&trees).map_err(io("listing", &trees))? {
            let path = entry.map_err(io("listing", &trees))?.path();
            let unused = path
                .file_name()
                .and_then(|name| name.to_str())
                .is_none_or(|name| !used.contains(name));
            if unused {
                fs::remove_dir_all(&path).map_err(io("removing", &path))?;
            }
        }
        Ok(())
    }

    /// The checksum of set `name`, recomputed from the files on disk: those its metadata
    /// lists (what HAProxy writes beside them does not count), or every regular file of its
    /// directory for a set whose metadata lists none; in the form of the checksum recorded
    /// for it ([`SetStore::checksum_form`]).
    pub fn checksum_on_disk(&self, name: &str) -> Result<String> {
        let files = self.read_files(name)?;
        Ok(haptic_agent_client::protocol::checksum_as(
            self.checksum_form(name),
            files
                .iter()
                .map(|(path, content)| (path.as_str(), content.as_slice())),
        ))
    }

    /// The form of the checksum recorded for set `name` (a set applied by a controller older
    /// than the second form has one in the first); the current form when none is recorded.
    pub fn checksum_form(&self, name: &str) -> Form {
        self.meta(name)
            .and_then(|meta| Form::of(&meta.checksum))
            .unwrap_or(Form::V2)
    }

    /// The files of set `name` as they are on disk (those its metadata lists, or every
    /// regular file of its directory), as a [`FileSet`].
    pub fn read_set(&self, name: &str) -> Result<FileSet> {
        self.read_set_stamped(name).map(|(set, _)| set)
    }

    /// [`SetStore::read_set`], with each file's [`Stamp`] taken before it was read (a file
    /// changed after its stamp has a stamp that no longer matches).
    pub fn read_set_stamped(&self, name: &str) -> Result<(FileSet, Stamps)> {
        let mut stamps = Stamps::new();
        let mut set = FileSet::new();
        for (path, content) in self.read_files_stamped(name, Some(&mut stamps))? {
            let full = self.set_dir(name).join(&path);
            set.insert(path, content)
                .map_err(|_| Error::Unexpected(full))?;
        }
        Ok((set, stamps))
    }

    /// The stamps of `paths` in set `name` as they are now (a path that is missing or not a
    /// regular file is an error).
    pub fn stamps<'a>(
        &self,
        name: &str,
        paths: impl IntoIterator<Item = &'a str>,
    ) -> Result<Stamps> {
        let dir = self.set_dir(name);
        paths
            .into_iter()
            .map(|path| {
                let full = dir.join(path);
                let metadata = fs::symlink_metadata(&full).map_err(io("inspecting", &full))?;
                if !metadata.is_file() {
                    return Err(Error::Unexpected(full));
                }
                Ok((path.to_owned(), Stamp::of(&metadata)))
            })
            .collect()
    }

    /// Whether every file of set `name` is on disk as `held` says: a file whose stamp still
    /// matches is taken as is, any other is read and compared (a file rewritten with the same
    /// content matches). False when a file differs, is missing, or has no stamp.
    pub fn matches(&self, name: &str, held: &FileSet, stamps: &Stamps) -> bool {
        let dir = self.set_dir(name);
        held.iter().all(|(path, content)| {
            let full = dir.join(path);
            let Ok(metadata) = fs::symlink_metadata(&full) else {
                return false;
            };
            if !metadata.is_file() {
                return false;
            }
            if stamps.get(path) == Some(&Stamp::of(&metadata)) {
                return true;
            }
            fs::read(&full).is_ok_and(|on_disk| on_disk == content.as_ref())
        })
    }

    fn read_files(&self, name: &str) -> Result<BTreeMap<String, Vec<u8>>> {
        self.read_files_stamped(name, None)
    }

    fn read_files_stamped(
        &self,
        name: &str,
        mut stamps: Option<&mut Stamps>,
    ) -> Result<BTreeMap<String, Vec<u8>>> {
        let dir = self.set_dir(name);
        let mut files = BTreeMap::new();
        match self.meta(name).map(|meta| meta.files) {
            Some(listed) if !listed.is_empty() => {
                for path in listed {
                    // Paths were validated when the set was written; a `..` in a tampered
                    // metadata file is not followed.
                    haptic_agent_client::protocol::validate_path(&path)
                        .map_err(|_| Error::Unexpected(dir.join(&path)))?;
                    let full = dir.join(&path);
                    let kind = fs::symlink_metadata(&full).map_err(io("inspecting", &full))?;
                    if !kind.is_file() {
                        return Err(Error::Unexpected(full));
                    }
                    let content = fs::read(&full).map_err(io("reading", &full))?;
                    if let Some(stamps) = stamps.as_deref_mut() {
                        stamps.insert(path.clone(), Stamp::of(&kind));
                    }
                    files.insert(path, content);
                }
            }
            _ => read_tree(&dir, "", &mut files, stamps)?,
        }
        Ok(files)
    }
}

/// Reads every regular file under `dir` into `files`, keyed by its `/`-joined relative path;
/// sockets and other special files (HAProxy's, made at run time) are not part of a set.
fn read_tree(
    dir: &Path,
    prefix: &str,
    files: &mut BTreeMap<String, Vec<u8>>,
    mut stamps: Option<&mut Stamps>,
) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(io("listing", dir))? {
        let entry = entry.map_err(io("listing", dir))?;
        let path = entry.path();
        let name = entry
            .file_name()
            .into_string()
            .map_err(|_| Error::Unexpected(path.clone()))?;
        let relative = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let kind = entry.file_type().map_err(io("inspecting", &path))?;
        if kind.is_dir() {
            read_tree(&path, &relative, files, stamps.as_deref_mut())?;
        } else if kind.is_file() {
            if let Some(stamps) = stamps.as_deref_mut() {
                let metadata = entry.metadata().map_err(io("inspecting", &path))?;
                stamps.insert(relative.clone(), Stamp::of(&metadata));
            }
            files.insert(relative, fs::read(&path).map_err(io("reading", &path))?);
        }
    }
    Ok(())
}

/// Removes a directory tree (and the other directories listed) when dropped, unless
/// disarmed (its path taken, the list cleared).
struct RemoveOnDrop(Option<PathBuf>, Vec<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = fs::remove_dir_all(dir);
        }
        for dir in self.1.drain(..) {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

/// The directory under `<data>` holding the trees.
const TREES: &str = "trees";

/// A top-level directory of a set with at least this many files is a tree.
pub const TREE_MIN_FILES: usize = 64;

/// The number of files under each top-level directory of `files`.
fn top_dirs(files: &FileSet) -> BTreeMap<&str, usize> {
    let mut dirs = BTreeMap::new();
    for (path, _) in files.iter() {
        if let Some((top, _)) = path.split_once('/') {
            *dirs.entry(top).or_insert(0) += 1;
        }
    }
    dirs
}

/// The paths of `files` under top-level directory `top`.
fn under<'a>(files: &'a FileSet, top: &'a str) -> impl Iterator<Item = &'a str> {
    files
        .iter()
        .map(|(path, _)| path)
        .filter(move |path| path.split_once('/').is_some_and(|(dir, _)| dir == top))
}

/// The tree `link` (a set's top-level entry) points to, if it is a symlink to one.
fn tree_of(link: &Path) -> Option<String> {
    let target = fs::read_link(link).ok()?;
    let mut parts = target.components().map(|part| part.as_os_str().to_str());
    let shape = [Some(".."), Some(".."), Some(TREES)];
    if !shape.iter().all(|want| parts.next() == Some(*want)) {
        return None;
    }
    let id = parts.next()??;
    (parts.next().is_none() && !id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| id.to_owned())
}

/// Fsyncs every regular file under `dir`, then each directory once its entries are synced.
fn sync_tree(dir: &Path, prefix: &str, skip: &dyn Fn(&str) -> bool) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(io("listing", dir))? {
        let entry = entry.map_err(io("listing", dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(io("inspecting", &path))?;
        let relative = format!("{prefix}{}", entry.file_name().to_string_lossy());
        if kind.is_dir() {
            sync_tree(&path, &format!("{relative}/"), skip)?;
        } else if kind.is_symlink() && tree_of(&path).is_some() {
            // A tree: its files (those not linked from another set), its directories, and
            // its entry in `trees`.
            sync_tree(&path, &format!("{relative}/"), skip)?;
            if let Some(trees) = fs::canonicalize(&path)
                .ok()
                .and_then(|tree| tree.parent().map(Path::to_path_buf))
            {
                sync_dir(&trees)?;
            }
        } else if kind.is_file() && !skip(&relative) {
            fs::File::open(&path)
                .and_then(|file| file.sync_all())
                .map_err(io("syncing", &path))?;
        }
    }
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Metadata of a set applied by leader `l` at epoch 1, generation 1.
    fn meta(checksum: &str) -> SetMeta {
        SetMeta {
            checksum: checksum.to_owned(),
            generation: 1,
            leader: "l".into(),
            epoch: 1,
            files: Vec::new(),
        }
    }

    #[test]
    fn staged_set_reads_back_with_the_same_checksum() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        let files = FileSet::new()
            .with("haproxy.cfg", "global\n")
            .and_then(|s| s.with("maps/a/b.map", vec![0u8, 1, 2]))
            .expect("set");
        let checksum = files.checksum();
        let (name, _) = store.stage(&files, &checksum).expect("stage");
        let meta = meta(&checksum);
        store.promote(&name, &meta).expect("promote");
        assert_eq!(store.checksum_on_disk(&name).expect("sum"), checksum);
        assert_eq!(store.meta(&name), Some(meta));

        store.set_link(CURRENT, Some(&name)).expect("link");
        assert_eq!(store.link(CURRENT).expect("read"), Some(name.clone()));
        assert!(store.current_path().join("maps/a/b.map").is_file());

        store.retain(&[]).expect("retain none");
        assert!(!store.set_dir(&name).exists());
        assert!(store.meta(&name).is_none());
    }

    #[test]
    fn a_set_written_then_synced_promotes_like_a_staged_one() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        let files = FileSet::new()
            .with("haproxy.cfg", "global\n")
            .and_then(|s| s.with("maps/a/b.map", vec![0u8, 1, 2]))
            .and_then(|s| s.with("ssl/c.pem", "pem"))
            .expect("set");
        let checksum = files.checksum();
        let (name, dir) = store.write_staged(&files, &checksum).expect("write");
        assert!(dir.join("maps/a/b.map").is_file());
        store.sync_staged(&name).expect("sync");
        let meta = meta(&checksum);
        store.promote(&name, &meta).expect("promote");
        assert_eq!(store.checksum_on_disk(&name).expect("sum"), checksum);
        assert!(store.sync_staged(&name).is_err(), "no longer in staging");
    }

    /// A set of `certs` certificates (a tree when there are enough), a map and a config.
    fn set_with_certs(certs: usize, changed: Option<usize>) -> FileSet {
        set_with_config(certs, changed, "global\n")
    }

    fn set_with_config(certs: usize, changed: Option<usize>, config: &'static str) -> FileSet {
        let mut files = FileSet::new()
            .with("haproxy.cfg", config)
            .and_then(|s| s.with("maps/hosts.map", "a b\n"))
            .expect("set");
        for i in 0..certs {
            let pem = if changed == Some(i) { "new" } else { "pem" };
            // Most at the tree's top (as the reference's `ssl/<namespace>_<secret>.pem`, linked
            // by name between the trees' directories), some a directory deeper.
            let path = if i % 4 == 1 {
                format!("certs/ns-{}/c{i}.pem", i % 3)
            } else {
                format!("certs/c{i}.pem")
            };
            files = files.with(path, format!("{pem} {i}")).expect("cert");
        }
        files
    }

    /// Writes `files` as the runtime path does (files unchanged from `base` linked), syncs,
    /// promotes; returns the set's name.
    fn write_reusing(store: &SetStore, files: &FileSet, base: Option<(&str, &FileSet)>) -> String {
        let checksum = files.checksum();
        let unchanged =
            |path: &str| base.is_some_and(|(_, base)| base.get(path) == files.get(path));
        let (name, _) = store
            .write_staged_reusing(files, &checksum, base, unchanged)
            .expect("write");
        store.sync_staged_reusing(&name, unchanged).expect("sync");
        let mut meta = meta(&checksum);
        meta.files = files.iter().map(|(path, _)| path.to_owned()).collect();
        store.promote(&name, &meta).expect("promote");
        assert_eq!(store.checksum_on_disk(&name).expect("sum"), checksum);
        name
    }

    fn trees(root: &Path) -> Vec<String> {
        let mut trees: Vec<String> = fs::read_dir(root.join(TREES))
            .expect("trees")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .into_string()
                    .expect("utf-8")
            })
            .collect();
        trees.sort();
        trees
    }

    #[test]
    fn a_large_directory_is_a_tree_that_unchanged_sets_share() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        let first = set_with_certs(TREE_MIN_FILES, None);
        let one = write_reusing(&store, &first, None);
        let tree = tree_of(&store.set_dir(&one).join("certs")).expect("certs is a tree");
        assert!(
            tree_of(&store.set_dir(&one).join("maps")).is_none(),
            "a small directory is not"
        );

        // The config changes, the certificates do not: the same tree, no file written there.
        let second = set_with_config(TREE_MIN_FILES, None, "global\n  maxconn 10\n");
        let two = write_reusing(&store, &second, Some((&one, &first)));
        assert_eq!(
            tree_of(&store.set_dir(&two).join("certs")),
            Some(tree.clone())
        );
        assert_eq!(trees(root.path()), vec![tree.clone()]);

        // One certificate changes: a tree of its own, the unchanged files hard-linked into it.
        let third = set_with_certs(TREE_MIN_FILES, Some(5));
        let three = write_reusing(&store, &third, Some((&two, &second)));
        let new_tree = tree_of(&store.set_dir(&three).join("certs")).expect("a tree");
        assert_ne!(new_tree, tree);
        let inode = |set: &str, path: &str| {
            fs::metadata(store.set_dir(set).join(path))
                .expect("file")
                .ino()
        };
        for unchanged in ["certs/c0.pem", "certs/ns-1/c1.pem", "certs/c6.pem"] {
            assert_eq!(
                inode(&two, unchanged),
                inode(&three, unchanged),
                "{unchanged}"
            );
        }
        assert_ne!(
            inode(&two, "certs/ns-2/c5.pem"),
            inode(&three, "certs/ns-2/c5.pem")
        );
        // A file at the top that changes: written, not linked.
        let fifth = set_with_certs(TREE_MIN_FILES, Some(6));
        let five = write_reusing(&store, &fifth, Some((&three, &third)));
        assert_ne!(inode(&three, "certs/c6.pem"), inode(&five, "certs/c6.pem"));
        assert_eq!(inode(&three, "certs/c2.pem"), inode(&five, "certs/c2.pem"));
        assert_eq!(
            fs::read(store.set_dir(&five).join("certs/c6.pem")).expect("read"),
            b"new 6"
        );
        store.retain(&[&two, &three]).expect("retain");

        // A certificate more (the same count would not do): a new tree too.
        let fourth = set_with_certs(TREE_MIN_FILES + 1, Some(5));
        let four = write_reusing(&store, &fourth, Some((&three, &third)));
        assert_ne!(
            tree_of(&store.set_dir(&four).join("certs")),
            Some(new_tree.clone())
        );
        assert!(store.set_dir(&four).join("certs/c64.pem").is_file());

        // A tree goes with the last set that links it.
        store.retain(&[&three, &four]).expect("retain");
        assert_eq!(trees(root.path()).len(), 2);
        assert!(!trees(root.path()).contains(&tree));
        store.retain(&[&four]).expect("retain");
        assert_eq!(trees(root.path()).len(), 1);
        assert_eq!(
            store.checksum_on_disk(&four).expect("sum"),
            fourth.checksum()
        );
    }

    #[test]
    fn a_set_that_fails_to_write_leaves_no_tree_and_open_removes_unused_ones() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        let files = set_with_certs(TREE_MIN_FILES, None);
        // Linking from a base that does not exist fails half-way.
        let failed = store.write_staged_reusing(
            &files,
            &files.checksum(),
            Some(("missing", &files)),
            |path| path.starts_with("certs/"),
        );
        assert!(failed.is_err());
        assert!(trees(root.path()).is_empty());
        fs::create_dir_all(root.path().join(TREES).join("0123abcd")).expect("mkdir");
        SetStore::open(root.path()).expect("open");
        assert!(trees(root.path()).is_empty());
    }

    #[test]
    fn open_clears_staging_leftovers() {
        let root = tempfile::tempdir().expect("tempdir");
        let leftover = root.path().join("staging/x");
        fs::create_dir_all(&leftover).expect("mkdir");
        SetStore::open(root.path()).expect("open");
        assert!(!leftover.exists());
    }
}
